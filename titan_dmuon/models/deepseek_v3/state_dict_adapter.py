"""DeepSeek-V3 weights <-> Hugging Face `DeepseekV3ForCausalLM` weights (deepseek-ai/DeepSeek-V3,
moonshotai/Moonlight-16B-A3B, moonshotai/Kimi-K2's layout): names, expert stacks and config.json. The machinery is
the shared adapter's (titan_dmuon/models/common/hf_adapter.py); this module picks DeepSeek-V3's names and writes its
config.json.

Every tensor is HF's under another name: our MLA applies RoPE to the rotary dims in the checkpoints' interleaved
pairs (HF's ``rope_interleave``), so no row moves. The routed experts are the published per-expert matrices
(`mlp.experts.{e}.gate_proj.weight`, ...) stacked, the shared experts `mlp.shared_experts.*`, the router
`mlp.gate.weight` and its selection bias `mlp.gate.e_score_correction_bias`. The multi-token-prediction layer of
DeepSeek-V3's checkpoint (`model.layers.61`, past our layers) has no weight of ours and is skipped on import, as
transformers skips it.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_dmuon.models.common.hf_adapter import DENSE_LAYER_NAMES, EXPERT_NAMES, ROUTER_NAMES, DecoderStateDictAdapter
from titan_dmuon.models.common.rope import Yarn

from .model import ModelArgs

MLA_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
SHARED_EXPERT_NAMES = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_DENSE = {k: v for k, v in DENSE_LAYER_NAMES.items() if not k.startswith("attention.")}


class DeepseekV3StateDictAdapter(DecoderStateDictAdapter):
    """Maps one DeepSeek-V3 configuration's state dict to and from Hugging Face's, tensor by tensor (an expert stack
    to and from one tensor per expert)."""

    family = "deepseek_v3"
    args_type = ModelArgs
    layer_names = {**_DENSE, **MLA_NAMES, **ROUTER_NAMES, **SHARED_EXPERT_NAMES}
    expert_names = EXPERT_NAMES
    config_keys = (
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "n_shared_experts",
        "routed_scaling_factor",
        "norm_topk_prob",
        "rms_norm_eps",
        "rope_theta",
    )

    def from_hf_name(self, hf_name: str) -> str | None:
        fqn = super().from_hf_name(hf_name)
        if fqn is not None and fqn.startswith("layers.") and int(fqn.split(".")[1]) >= self.args.n_layers:
            return None  # DeepSeek-V3's multi-token-prediction layer
        return fqn

    def absent_zeros(self) -> list[str]:
        """The MoE layers' selection biases (zero when a folder has none)."""
        moe_layers = filter(self.args.is_moe_layer, range(self.args.n_layers))
        return [f"layers.{i}.feed_forward.router.expert_bias" for i in moe_layers]

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """Also: the folder's RoPE scaling must compute what ours does: the frequencies, the cos/sin factor and the
        softmax scale (each depends on more fields than the factor; `Yarn.scales_like`). And its weights must be
        plain: the published DeepSeek-V3 and Kimi K2 folders hold FP8 blocks with `weight_scale_inv` scales, which an
        import would cast without their scales."""
        if config.get("quantization_config"):
            method = config["quantization_config"].get("quant_method", "?")
            raise ValueError(
                f"config.json has a quantization_config ({method}): the weights are quantized (e.g. FP8 blocks with "
                "weight_scale_inv scales); dequantize the folder to bf16 first (e.g. DeepSeek's fp8_cast_bf16.py)"
            )
        super().check_hf_config(config)
        a = self.args
        theirs = config.get("rope_scaling") or config.get("rope_parameters") or {}
        ours = a.rope_scaling
        kind = theirs.get("rope_type", theirs.get("type", "default"))
        same = (kind == "yarn") == (ours is not None)
        if same and ours is not None:
            try:
                same = Yarn.from_hf(theirs).scales_like(ours, a.qk_rope_head_dim, a.rope_theta)
            except KeyError:
                same = False
        if not same:
            raise ValueError(f"config.json's RoPE scaling {theirs or None} is not the model's ({ours})")

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `DeepseekV3ForCausalLM` with this configuration's shapes and the published field names."""
        a = self.args
        config = self.decoder_config(dtype)
        rope = {"rope_type": "default"} if a.rope_scaling is None else a.rope_scaling.hf()
        config.update(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "head_dim": a.qk_rope_head_dim,
                "num_key_value_heads": a.n_heads,
                "q_lora_rank": a.q_lora_rank or None,
                "kv_lora_rank": a.kv_lora_rank,
                "qk_nope_head_dim": a.qk_nope_head_dim,
                "qk_rope_head_dim": a.qk_rope_head_dim,
                "v_head_dim": a.v_head_dim,
                "rope_interleave": True,
                "rope_scaling": None if a.rope_scaling is None else a.rope_scaling.hf(),
                "rope_parameters": {**rope, "rope_theta": a.rope_theta},
                "n_routed_experts": a.num_experts,
                "num_experts_per_tok": a.top_k,
                "moe_intermediate_size": a.moe_hidden_dim,
                "n_shared_experts": a.n_shared_experts,
                "first_k_dense_replace": a.first_k_dense_replace if a.num_experts else a.n_layers,
                "n_group": a.n_group,
                "topk_group": a.topk_group,
                "routed_scaling_factor": a.routed_scaling_factor,
                "norm_topk_prob": a.norm_topk_prob,
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "moe_layer_freq": 1,
                "num_nextn_predict_layers": 0,
                "attention_dropout": 0.0,
                "initializer_range": 0.02,
                "use_cache": True,
            }
        )
        return config


__all__ = ["DeepseekV3StateDictAdapter", "MLA_NAMES", "SHARED_EXPERT_NAMES"]
