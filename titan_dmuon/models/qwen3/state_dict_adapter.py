"""Qwen3 weights <-> Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` weights: names, tied embeddings, MoE
experts and config.json.

Our attention applies RoPE in Hugging Face's rotate_half layout (model.py `apply_rope`), so every tensor is HF's
tensor under another name: no row moves (`needs_full_tensor` is always false), and a shard of ours is a plain
slice of the HF tensor.

Tied embeddings (`tie_embeddings`, `tie_word_embeddings` in config.json): our state dict lists the shared matrix
once, as `tok_embeddings.weight` -> `model.embed_tokens.weight`, so an export holds no `lm_head.weight`, as
Hugging Face saves a tied model. On import an untied model of ours reads its output from the embedding when the
folder is tied (`tied_hf_name`); a tied model of ours refuses an untied folder (its lm_head would be dropped).

Qwen3-MoE (`num_experts > 0`, `Qwen3MoeForCausalLM`, model_type "qwen3_moe"): the router's gate is
`mlp.gate.weight`, and each of our 3-D expert params is the stack of the published per-expert matrices
(`stacked_hf_names`): `experts.w1` [E, hidden, dim] of `mlp.experts.{e}.gate_proj.weight`, `w3` of `up_proj`, `w2`
[E, dim, hidden] of `down_proj` (the safetensors layout of the published checkpoints; transformers fuses them into
its own 3-D params when it loads them). The router's aux-loss-free selection bias (`router.expert_bias`) has no
Qwen3-MoE counterpart: zero (HF's routing) it is left out of an export and read as zeros from a folder without it
(`zero_when_absent`, the published checkpoints); moved by training it is written as
`mlp.gate.e_score_correction_bias` (DeepSeek-V3's name for such a bias), which transformers' Qwen3-MoE does not
read: it then routes without the bias, so its outputs differ from ours.

`titan_dmuon/components/hf.py` drives the adapter (export_hf, load_hf_weights); `scripts/convert_checkpoint.py`
converts DCP checkpoints with it.
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
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
# our 3-D expert param inside `layers.N.feed_forward.experts.` -> HF per-expert matrix inside `mlp.experts.{e}.`
_EXPERT_NAMES = {"w1": "gate_proj.weight", "w3": "up_proj.weight", "w2": "down_proj.weight"}
_HF_EXPERT_NAMES = {v: k for k, v in _EXPERT_NAMES.items()}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w1|w2|w3)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(.+)$")


class Qwen3StateDictAdapter:
    """Maps one Qwen3 (or Qwen3-MoE) configuration's state dict to and from Hugging Face's, tensor by tensor (an
    expert param to and from one tensor per expert)."""

    def __init__(self, args: ModelArgs):
        self.args = args

    @classmethod
    def from_model(cls, model: nn.Module) -> Qwen3StateDictAdapter:
        """The adapter for a built Transformer (on meta, materialized or parallelized, or inside a wrapper with
        `.module`: only its args are read)."""
        while not hasattr(model, "args") and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        if not isinstance(getattr(model, "args", None), ModelArgs):
            raise TypeError(f"expected a qwen3 Transformer (with qwen3 ModelArgs .args), got {type(model).__name__}")
        return cls(model.args)

    def to_hf_name(self, fqn: str) -> str:
        """The HF name of `fqn`; for a stacked expert param, the pattern of its pieces' names (`experts.*.`)."""
        if fqn in _TOP_NAMES:
            return _TOP_NAMES[fqn]
        m = _OUR_EXPERTS.match(fqn)
        if m is not None:
            return f"model.layers.{m.group(1)}.mlp.experts.*.{_EXPERT_NAMES[m.group(2)]}"
        m = _OUR_LAYER.match(fqn)
        if m is None or m.group(2) not in _LAYER_NAMES:
            raise KeyError(f"qwen3 has no Hugging Face name for {fqn!r}")
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"

    def from_hf_name(self, hf_name: str) -> str | None:
        """Our FQN for an HF tensor name; None for names with no weight of ours."""
        if hf_name in _HF_TOP_NAMES:
            return _HF_TOP_NAMES[hf_name]
        m = _HF_LAYER.match(hf_name)
        if m is None:
            return None
        expert = _HF_EXPERT.match(m.group(2))
        if expert is not None:  # one expert's matrix: a piece of our stacked param
            w = _HF_EXPERT_NAMES.get(expert.group(1))
            return None if w is None else f"layers.{m.group(1)}.feed_forward.experts.{w}"
        if m.group(2) not in _HF_LAYER_NAMES:
            return None
        return f"layers.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"

    def zero_when_absent(self, fqn: str) -> bool:
        """True for the routers' selection biases: a folder without them means zero biases (HF's routing)."""
        return fqn.endswith(".feed_forward.router.expert_bias")

    def stacked_hf_names(self, fqn: str) -> list[str] | None:
        """The per-expert HF matrices (expert 0 first) whose stack is our expert param `fqn`; None otherwise."""
        m = _OUR_EXPERTS.match(fqn)
        if m is None:
            return None
        layer, hf = m.group(1), _EXPERT_NAMES[m.group(2)]
        return [f"model.layers.{layer}.mlp.experts.{e}.{hf}" for e in range(self.args.num_experts)]

    def tied_hf_name(self, fqn: str) -> str | None:
        """Where a checkpoint with `tie_word_embeddings` keeps `fqn` instead (Qwen3 0.6B/1.7B/4B store no lm_head)."""
        return _TOP_NAMES["tok_embeddings.weight"] if fqn == "output.weight" else None

    def needs_full_tensor(self, fqn: str) -> bool:
        """Always False: the conversion renames only (RoPE is in HF's layout already)."""
        return False

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole (full-tensor) state dict of ours in HF names (a tied model's `output.weight`, if the dict has it,
        is left out: HF keeps the shared matrix as the embedding only; a stacked expert param becomes one tensor
        per expert)."""
        tied = self.args.tie_embeddings
        out = {}
        for k, v in sd.items():
            names = self.stacked_hf_names(k)
            if names is not None:
                out.update(zip(names, v.unbind(0), strict=True))
            elif not (tied and k == "output.weight") and not (self.zero_when_absent(k) and not v.any()):
                out[self.to_hf_name(k)] = v
        return out

    def from_hf_state_dict(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict in our FQNs (HF names without a weight of ours are dropped; a tied model's
        `lm_head.weight`, if present, too; per-expert matrices are stacked into our 3-D params; absent routers'
        selection biases are zeros)."""
        out = {}
        pieces: set[str] = set()
        for name, tensor in hf_sd.items():
            fqn = self.from_hf_name(name)
            if fqn is not None and _OUR_EXPERTS.match(fqn):
                pieces.add(fqn)
            elif fqn is not None and not (self.args.tie_embeddings and fqn == "output.weight"):
                out[fqn] = tensor
        for fqn in sorted(pieces):
            out[fqn] = torch.stack([hf_sd[n] for n in self.stacked_hf_names(fqn)])
        for i in filter(self.args.is_moe_layer, range(self.args.n_layers)):
            out.setdefault(f"layers.{i}.feed_forward.router.expert_bias", torch.zeros(self.args.num_experts))
        if not self.args.tie_embeddings and "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]  # a tied checkpoint into an untied model
        return out

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError when a folder's config.json has other head counts or head_dim than ours (the shapes alone
        could still agree), or unties what our model ties (its lm_head would be dropped)."""
        ours = self.hf_config()
        keys = ("num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob")
        for key in (k for k in keys if k in ours):
            if config.get(key) is not None and config[key] != ours[key]:
                raise ValueError(f"{key} is {config[key]} in config.json but {ours[key]} in the model")
        if config and self.args.tie_embeddings and not config.get("tie_word_embeddings", False):
            raise ValueError(
                "config.json has untied embeddings (tie_word_embeddings false: an lm_head of its own) but the model "
                "ties its output to the embedding; use an untied flavor (8B, 14B, 32B) or tie_embeddings=False"
            )

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `Qwen3ForCausalLM` with this configuration's shapes and the published field names: plain
        RoPE, no sliding window, no biases; `max_position_embeddings` is our RoPE table's length (max_seq_len)."""
        a = self.args
        dtype_name = str(dtype).removeprefix("torch.")
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
        if a.num_experts > 0:
            config.update(self._moe_config())
        return config

    def _moe_config(self) -> dict[str, Any]:
        """Qwen3MoeConfig's fields (Qwen/Qwen3-30B-A3B's config.json names); intermediate_size stays the dense
        layers' width."""
        a = self.args
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": a.num_experts,
            "num_experts_per_tok": a.top_k,
            "moe_intermediate_size": a.moe_hidden_dim,
            "norm_topk_prob": a.norm_topk_prob,
            "decoder_sparse_step": a.decoder_sparse_step,
            "mlp_only_layers": list(a.mlp_only_layers),
            "router_aux_loss_coef": a.aux_loss_coef,
            "output_router_logits": False,
        }


__all__ = ["Qwen3StateDictAdapter"]
