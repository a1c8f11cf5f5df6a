"""Llama-3 weights <-> Hugging Face `LlamaForCausalLM` weights: names, the RoPE row permutation and config.json.

Our attention applies RoPE to consecutive pairs of a head's dimensions (Meta's layout, `apply_rope`); Hugging
Face's `rotate_half` pairs dimension i with i + head_dim/2. The two models agree when the rows of wq and wk
are permuted within each head: our row 2i + c (pair i, component c) is HF row c * head_dim/2 + i, the
permutation `transformers`' convert_llama_weights_to_hf applies to Meta's checkpoints. wv, wo and the rest
are the same matrices under other names.

`titan_dmuon/components/hf.py` drives the adapter (export_hf, load_hf_weights); `scripts/convert_checkpoint.py` converts
DCP checkpoints with it. It works on whole tensors: a caller that holds a shard reads plain slices where
`needs_full_tensor` is false, and where it is true the HF rows its rows come from (`from_hf` permutes rows only).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from .model import ModelArgs

# our FQN suffix inside `layers.N.` -> HF suffix inside `model.layers.N.`
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from our interleaved-pair RoPE layout to HF's rotate_half layout, per head
    (`transformers`' convert_llama_weights_to_hf `permute`)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3StateDictAdapter:
    """Maps one Llama-3 configuration's state dict to and from Hugging Face Llama's, tensor by tensor."""

    def __init__(self, args: ModelArgs):
        self.args = args
        # FQN suffix -> the head count its rows are grouped in, for the projections RoPE rotates
        self._permuted = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}

    @classmethod
    def from_model(cls, model: nn.Module) -> Llama3StateDictAdapter:
        """The adapter for a built Transformer (on meta, materialized or parallelized, or inside a wrapper with
        `.module` such as DistributedDataParallel: only its args are read)."""
        while not hasattr(model, "args") and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        if not isinstance(getattr(model, "args", None), ModelArgs):
            raise TypeError(f"expected a llama3 Transformer (with ModelArgs .args), got {type(model).__name__}")
        return cls(model.args)

    def to_hf_name(self, fqn: str) -> str:
        if fqn in _TOP_NAMES:
            return _TOP_NAMES[fqn]
        m = _OUR_LAYER.match(fqn)
        if m is None or m.group(2) not in _LAYER_NAMES:
            raise KeyError(f"llama3 has no Hugging Face name for {fqn!r}")
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"

    def from_hf_name(self, hf_name: str) -> str | None:
        """Our FQN for an HF tensor name; None for names with no weight of ours (e.g. `rotary_emb.inv_freq`)."""
        if hf_name in _HF_TOP_NAMES:
            return _HF_TOP_NAMES[hf_name]
        m = _HF_LAYER.match(hf_name)
        if m is None or m.group(2) not in _HF_LAYER_NAMES:
            return None
        return f"layers.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"

    def tied_hf_name(self, fqn: str) -> str | None:
        """Where a checkpoint with `tie_word_embeddings` keeps `fqn` instead (Llama 3.2 1B/3B store no lm_head)."""
        return _TOP_NAMES["tok_embeddings.weight"] if fqn == "output.weight" else None

    def _heads(self, fqn: str) -> int | None:
        m = _OUR_LAYER.match(fqn)
        return self._permuted.get(m.group(2)) if m else None

    def needs_full_tensor(self, fqn: str) -> bool:
        """True when converting `fqn` moves rows around (q/k): a shard of it is not a slice of the HF tensor."""
        return self._heads(fqn) is not None

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our full tensor `fqn` as HF stores it."""
        heads = self._heads(fqn)
        return tensor if heads is None else permute_to_hf(tensor, heads)

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full HF tensor for `fqn` in our layout."""
        heads = self._heads(fqn)
        return tensor if heads is None else permute_from_hf(tensor, heads)

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole (full-tensor) state dict of ours in HF names and layout."""
        return {self.to_hf_name(k): self.to_hf(k, v) for k, v in sd.items()}

    def from_hf_state_dict(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict in our FQNs and layout (HF names without a weight of ours are dropped)."""
        out = {}
        for name, tensor in hf_sd.items():
            fqn = self.from_hf_name(name)
            if fqn is not None:
                out[fqn] = self.from_hf(fqn, tensor)
        return out

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError when a folder's config.json has other head counts than ours: the shapes could still agree
        (the same width in more, narrower heads), but the q/k permutation, done per head, would be wrong."""
        ours = self.hf_config()
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            if config.get(key) is not None and config[key] != ours[key]:
                raise ValueError(f"{key} is {config[key]} in config.json but {ours[key]} in the model")

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `LlamaForCausalLM` with this configuration's shapes. Plain RoPE (no Llama 3.1 scaling),
        untied output, no biases; `max_position_embeddings` is our RoPE table's length (max_seq_len)."""
        a = self.args
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }


__all__ = ["Llama3StateDictAdapter", "permute_from_hf", "permute_to_hf"]
