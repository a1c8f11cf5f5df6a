"""Qwen3 weights <-> Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` weights: names, tied embeddings, MoE
experts and config.json. The machinery (names, tied embeddings, expert stacks) is the shared adapter's
(titan_dmuon/models/common/hf_adapter.py); this module picks Qwen3's names and writes its config.json.

Our attention applies RoPE in Hugging Face's rotate_half layout (common/rope.py), so every tensor is HF's tensor
under another name: no row moves (`needs_full_tensor` is always false), and a shard of ours is a plain slice of the
HF tensor. The q/k norms are `self_attn.q_norm` / `k_norm`. Qwen3 0.6B, 1.7B and 4B tie their embeddings.

Qwen3-MoE (`num_experts > 0`, `Qwen3MoeForCausalLM`, model_type "qwen3_moe"): the router's gate is
`mlp.gate.weight`, and each of our 3-D expert params is the stack of the published per-expert matrices (the
safetensors layout of the published checkpoints; transformers fuses them into its own 3-D params when it loads
them). The router's aux-loss-free selection bias (`router.expert_bias`) has no Qwen3-MoE counterpart: zero (HF's
routing) it is left out of an export and read as zeros from a folder without it (the published checkpoints);
moved by training it is written as `mlp.gate.e_score_correction_bias` (DeepSeek-V3's name for such a bias), which
transformers' Qwen3-MoE does not read: it then routes without the bias, so its outputs differ from ours.

`titan_dmuon/components/checkpoint/hf_io.py` drives the adapter (export_hf, load_hf_weights);
`scripts/convert_checkpoint.py` converts DCP checkpoints with it.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_dmuon.models.common.hf_adapter import (
    DENSE_LAYER_NAMES,
    EXPERT_NAMES,
    QK_NORM_NAMES,
    ROUTER_NAMES,
    DecoderStateDictAdapter,
)

from .model import ModelArgs


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    """Maps one Qwen3 (or Qwen3-MoE) configuration's state dict to and from Hugging Face's, tensor by tensor (an
    expert param to and from one tensor per expert)."""

    family = "qwen3"
    args_type = ModelArgs
    layer_names = {**DENSE_LAYER_NAMES, **QK_NORM_NAMES, **ROUTER_NAMES}
    expert_names = EXPERT_NAMES
    config_keys = ("num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob")

    def absent_zeros(self) -> list[str]:
        """The MoE layers' selection biases (the published checkpoints have none)."""
        moe_layers = filter(self.args.is_moe_layer, range(self.args.n_layers))
        return [f"layers.{i}.feed_forward.router.expert_bias" for i in moe_layers]

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `Qwen3ForCausalLM` (`Qwen3MoeForCausalLM` with experts) with this configuration's shapes
        and the published field names: plain RoPE, no sliding window, no biases; `max_position_embeddings` is our
        RoPE table's length (max_seq_len)."""
        a = self.args
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **self.decoder_config(dtype),
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
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
