"""The Hugging Face state-dict adapter both families share (titan_dmuon/components/checkpoint/hf_io.py's
`StateDictAdapter`): our FQNs <-> HF names, tied embeddings, MoE expert stacks, config.json checks. It works on
whole tensors.

A family subclasses `DecoderStateDictAdapter` with its names (`layer_names`, `expert_names`), its args type and
`hf_config`; it overrides `to_hf` / `from_hf` / `needs_full_tensor` only where a tensor's layout differs from HF's
(Llama 3's q/k rows, permuted for RoPE). The name tables below are Hugging Face's for Llama-style decoders
(`LlamaForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM` and DeepSeek-V3 share them).

Tied embeddings (`tie_embeddings`, `tie_word_embeddings` in config.json): our state dict lists the shared matrix
once, as `tok_embeddings.weight` -> `model.embed_tokens.weight`, so an export holds no `lm_head.weight`, as
Hugging Face saves a tied model. On import an untied model of ours reads its output from the embedding when the
folder is tied (`tied_hf_name`); a tied model of ours refuses an untied folder (its lm_head would be dropped).

MoE experts: each of our 3-D expert params is the stack of the published per-expert matrices (`stacked_hf_names`):
`experts.w1` [E, hidden, dim] of `mlp.experts.{e}.gate_proj.weight`, `w3` of `up_proj`, `w2` [E, dim, hidden] of
`down_proj`. The router's aux-loss-free selection bias (`router.expert_bias`) is left out of an export when zero
and read as zeros from a folder without it (`zero_when_absent`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

# our FQN suffix inside `layers.N.` -> HF suffix inside `model.layers.N.`: the dense decoder block
DENSE_LAYER_NAMES = {
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
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# the router of an MoE block; `expert_bias` under DeepSeek-V3's name for such a bias
ROUTER_NAMES = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
# our 3-D expert param inside `layers.N.feed_forward.experts.` -> HF per-expert matrix inside `mlp.experts.{e}.`
EXPERT_NAMES = {"w1": "gate_proj.weight", "w3": "up_proj.weight", "w2": "down_proj.weight"}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(\w+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(.+)$")


def layer_suffix(fqn: str) -> str | None:
    """The part of `fqn` inside its block (`attention.wq.weight` of `layers.3.attention.wq.weight`); None outside
    the blocks."""
    m = _OUR_LAYER.match(fqn)
    return None if m is None else m.group(2)


class DecoderStateDictAdapter:
    """Maps one configuration's state dict to and from Hugging Face's, tensor by tensor (an expert param to and
    from one tensor per expert). Subclasses set the class attributes and `hf_config`."""

    family: ClassVar[str]
    """The family's name, for error messages."""
    args_type: ClassVar[type]
    """The family's ModelArgs: `from_model` refuses another family's model."""
    layer_names: ClassVar[Mapping[str, str]]
    """Our FQN suffix inside `layers.N.` -> HF suffix inside `model.layers.N.`."""
    expert_names: ClassVar[Mapping[str, str]] = {}
    """Our expert stack inside `layers.N.feed_forward.experts.` -> the HF matrix inside `mlp.experts.{e}.`."""
    config_keys: ClassVar[tuple[str, ...]] = ("num_attention_heads", "num_key_value_heads", "head_dim")
    """config.json fields that must agree with ours (where our config has them): the shapes alone could agree."""

    def __init__(self, args: Any):
        self.args = args
        self._hf_layer_names = {v: k for k, v in self.layer_names.items()}
        self._hf_expert_names = {v: k for k, v in self.expert_names.items()}

    @property
    def tied(self) -> bool:
        """Whether the output head is the embedding (`tie_embeddings`; a family without the field never ties)."""
        return bool(getattr(self.args, "tie_embeddings", False))

    @classmethod
    def from_model(cls, model: nn.Module) -> DecoderStateDictAdapter:
        """The adapter for a built Transformer (on meta, materialized or parallelized, or inside a wrapper with
        `.module` such as DistributedDataParallel: only its args are read)."""
        while not hasattr(model, "args") and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        if not isinstance(getattr(model, "args", None), cls.args_type):
            raise TypeError(
                f"expected a {cls.family} Transformer (with {cls.family} ModelArgs .args), got {type(model).__name__}"
            )
        return cls(model.args)

    def _expert(self, fqn: str) -> re.Match | None:
        m = _OUR_EXPERTS.match(fqn)
        return m if m is not None and m.group(2) in self.expert_names else None

    def to_hf_name(self, fqn: str) -> str:
        """The HF name of `fqn`; for a stacked expert param, the pattern of its pieces' names (`experts.*.`)."""
        if fqn in TOP_NAMES:
            return TOP_NAMES[fqn]
        m = self._expert(fqn)
        if m is not None:
            return f"model.layers.{m.group(1)}.mlp.experts.*.{self.expert_names[m.group(2)]}"
        m = _OUR_LAYER.match(fqn)
        if m is None or m.group(2) not in self.layer_names:
            raise KeyError(f"{self.family} has no Hugging Face name for {fqn!r}")
        return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}"

    def from_hf_name(self, hf_name: str) -> str | None:
        """Our FQN for an HF tensor name; None for names with no weight of ours (e.g. `rotary_emb.inv_freq`)."""
        if hf_name in _HF_TOP_NAMES:
            return _HF_TOP_NAMES[hf_name]
        m = _HF_LAYER.match(hf_name)
        if m is None:
            return None
        expert = _HF_EXPERT.match(m.group(2))
        if expert is not None:  # one expert's matrix: a piece of our stacked param
            w = self._hf_expert_names.get(expert.group(1))
            return None if w is None else f"layers.{m.group(1)}.feed_forward.experts.{w}"
        if m.group(2) not in self._hf_layer_names:
            return None
        return f"layers.{m.group(1)}.{self._hf_layer_names[m.group(2)]}"

    def zero_when_absent(self, fqn: str) -> bool:
        """True for the routers' selection biases: a folder without them means zero biases (HF's routing)."""
        return fqn.endswith(".feed_forward.router.expert_bias")

    def stacked_hf_names(self, fqn: str) -> list[str] | None:
        """The per-expert HF matrices (expert 0 first) whose stack is our expert param `fqn`; None otherwise."""
        m = self._expert(fqn)
        if m is None:
            return None
        layer, hf = m.group(1), self.expert_names[m.group(2)]
        return [f"model.layers.{layer}.mlp.experts.{e}.{hf}" for e in range(self.args.num_experts)]

    def tied_hf_name(self, fqn: str) -> str | None:
        """Where a checkpoint with `tie_word_embeddings` keeps `fqn` instead (Llama 3.2 1B/3B and Qwen3 0.6B/1.7B/4B
        store no lm_head)."""
        return TOP_NAMES["tok_embeddings.weight"] if fqn == "output.weight" else None

    def needs_full_tensor(self, fqn: str) -> bool:
        """True when converting `fqn` moves rows around: a shard of it is not a slice of the HF tensor. Here never
        (the conversion renames only)."""
        return False

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our full tensor `fqn` as HF stores it."""
        return tensor

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full HF tensor for `fqn` in our layout."""
        return tensor

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole (full-tensor) state dict of ours in HF names and layout (a tied model's `output.weight`, if the
        dict has it, is left out: HF keeps the shared matrix as the embedding only; a stacked expert param becomes
        one tensor per expert; a zero selection bias is left out)."""
        out = {}
        for k, v in sd.items():
            names = self.stacked_hf_names(k)
            if names is not None:
                out.update(zip(names, v.unbind(0), strict=True))
            elif not (self.tied and k == "output.weight") and not (self.zero_when_absent(k) and not v.any()):
                out[self.to_hf_name(k)] = self.to_hf(k, v)
        return out

    def from_hf_state_dict(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict in our FQNs and layout (HF names without a weight of ours are dropped; a tied
        model's `lm_head.weight`, if present, too; per-expert matrices are stacked into our 3-D params; absent
        routers' selection biases are zeros; an untied model's output is a tied folder's embedding)."""
        out = {}
        pieces: set[str] = set()
        for name, tensor in hf_sd.items():
            fqn = self.from_hf_name(name)
            if fqn is not None and self._expert(fqn):
                pieces.add(fqn)
            elif fqn is not None and not (self.tied and fqn == "output.weight"):
                out[fqn] = self.from_hf(fqn, tensor)
        for fqn in sorted(pieces):
            out[fqn] = torch.stack([hf_sd[n] for n in self.stacked_hf_names(fqn)])
        for fqn in self.absent_zeros():
            out.setdefault(fqn, torch.zeros(self.args.num_experts))
        if not self.tied and "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]  # a tied checkpoint into an untied model
        return out

    def absent_zeros(self) -> list[str]:
        """The FQNs `from_hf_state_dict` fills with zeros when the HF state dict lacks them (the MoE layers'
        selection biases): none here."""
        return []

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError when a folder's config.json has other head counts or head_dim than ours (the shapes alone
        could still agree, but e.g. Llama 3's q/k permutation, done per head, would be wrong), or unties what our
        model ties (its lm_head would be dropped)."""
        ours = self.hf_config()
        for key in (k for k in self.config_keys if k in ours):
            if config.get(key) is not None and config[key] != ours[key]:
                raise ValueError(f"{key} is {config[key]} in config.json but {ours[key]} in the model")
        if config and self.tied and not config.get("tie_word_embeddings", False):
            raise ValueError(
                "config.json has untied embeddings (tie_word_embeddings false: an lm_head of its own) but the model "
                "ties its output to the embedding; use an untied flavor or tie_embeddings=False"
            )

    def decoder_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The config.json fields every Llama-style HF decoder has, from this configuration's shapes: plain RoPE,
        no biases; `max_position_embeddings` is our RoPE table's length (max_seq_len)."""
        a = self.args
        dtype_name = str(dtype).removeprefix("torch.")
        return {
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
            "tie_word_embeddings": self.tied,
            "attention_bias": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for the family's HF class with this configuration's shapes."""
        raise NotImplementedError


__all__ = [
    "DENSE_LAYER_NAMES",
    "DecoderStateDictAdapter",
    "EXPERT_NAMES",
    "QK_NORM_NAMES",
    "ROUTER_NAMES",
    "TOP_NAMES",
    "layer_suffix",
]
