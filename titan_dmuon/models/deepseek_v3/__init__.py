"""DeepSeek-V3 model family (multi-head latent attention, DeepSeekMoE): flavors (the published shapes of
Moonlight-16B-A3B, DeepSeek-V3 671B and Kimi K2, the last two also without their long-context RoPE scaling for the
4K pretraining stage, and CPU-sized ones), Hugging Face adapter, and its ModelSpec
(registered as "deepseek_v3" when this package is imported). The builder, TP plan, activation estimate, per-head
blocks and MoE are the shared core's (titan_dmuon/models/common/)."""

from __future__ import annotations

import dataclasses

from titan_dmuon.components.model import register_model_spec
from titan_dmuon.models.common.rope import Yarn
from titan_dmuon.models.common.spec import DecoderFamily

from .model import ModelArgs, Transformer, build_block, get_nparams_and_flops
from .state_dict_adapter import DeepseekV3StateDictAdapter

KIMI_VOCAB_SIZE = 163840  # Moonlight and Kimi K2
DEEPSEEK_V3_VOCAB_SIZE = 129280

# Our auxiliary loss is E * sum_e f_e P_e per MoE layer (f_e: routed pairs per token), averaged over the layers;
# DeepSeek's is alpha * (E / top_k) * sum_e f_e P_e per layer, summed over them (and per sequence, ours per batch):
# alpha of theirs is alpha * n_moe_layers / top_k of ours.
_DEEPSEEK_V3 = ModelArgs(
    dim=7168,
    n_layers=61,
    n_heads=128,
    vocab_size=DEEPSEEK_V3_VOCAB_SIZE,
    ffn_hidden_dim=18432,
    rope_theta=10000.0,
    rope_scaling=Yarn(
        factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0
    ),
    q_lora_rank=1536,
    num_experts=256,
    top_k=8,
    moe_hidden_dim=2048,
    n_shared_experts=1,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    aux_loss_coef=1e-4 * 58 / 8,  # the report's alpha 1e-4 over its 58 MoE layers and top-8 (see above)
    bias_update_rate=0.001,  # the report's bias update speed
)
_KIMI_K2 = dataclasses.replace(
    _DEEPSEEK_V3,
    n_heads=64,
    vocab_size=KIMI_VOCAB_SIZE,
    rope_theta=50000.0,
    rope_scaling=Yarn(
        factor=32, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1, mscale=1.0, mscale_all_dim=1.0
    ),
    num_experts=384,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    aux_loss_coef=0.0,  # auxiliary-loss-free balancing only
)

deepseek_v3_configs: dict[str, ModelArgs] = {
    # Sized for a laptop CPU (vocab_size from the tokenizer): a query latent, a dense first layer, 8 routed experts
    # in 4 groups of which 2 are searched, a shared expert.
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        ffn_hidden_dim=768,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        bias_update_rate=0.001,
    ),
    # For multi-rank end-to-end tests on a few CPU cores: 2 blocks (one dense, one sparse), 4 heads (TP 2 divides
    # them), 8 experts (EP 2, 4 or 8), groups.
    "tinymodel": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden_dim=128,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    # moonshotai/Moonlight-16B-A3B config.json: no query latent, 64 experts of which 6 (no groups), 2 shared
    "moonlight_16b_a3b": ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=KIMI_VOCAB_SIZE,
        ffn_hidden_dim=11264,
        norm_eps=1e-5,
        rope_theta=50000.0,
        q_lora_rank=0,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.446,
        aux_loss_coef=0.001 * 26 / 6,  # its config.json's aux_loss_alpha 0.001 over 26 MoE layers and top-6
        bias_update_rate=0.001,  # auxiliary-loss-free balancing at DeepSeek-V3's rate (noaux_tc)
    ),
    # deepseek-ai/DeepSeek-V3 config.json (its multi-token-prediction layer not built)
    "671B": _DEEPSEEK_V3,
    # moonshotai/Kimi-K2-Base config.json: DeepSeek-V3 with 64 heads, 384 experts (no groups), one dense layer
    "kimi_k2": _KIMI_K2,
    # The pretraining stage of both (4K sequences with plain RoPE; YaRN stretched it to 128K afterwards): the same
    # shapes and weights without the RoPE scaling, whose softmax scale and frequencies are the long-context ones
    "671B_pretrain": dataclasses.replace(_DEEPSEEK_V3, rope_scaling=None),
    "kimi_k2_pretrain": dataclasses.replace(_KIMI_K2, rope_scaling=None),
}


FAMILY = DecoderFamily("deepseek_v3", deepseek_v3_configs, Transformer)
get_model_args = FAMILY.get_model_args
build_model = FAMILY.build_model

# Muon takes every matrix of the blocks: MLA's down and up projections and wo, the dense and shared SwiGLUs, the
# routed expert stacks (one matrix per expert). AdamW: the embedding, the norms (q_norm, kv_norm included), the
# router's gate (an E x dim matrix: see qwen3's note) and the output head.
MUON_PARAMS = (
    r"^layers\.\d+\.(attention\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo)|feed_forward\.(w1|w2|w3))\.weight$"
    r"|^layers\.\d+\.feed_forward\.shared_experts\.(w1|w2|w3)\.weight$"
    r"|^layers\.\d+\.feed_forward\.experts\.(w1|w2|w3)$"
)

SPEC = register_model_spec(
    FAMILY.spec(muon_params=MUON_PARAMS, state_dict_adapter=DeepseekV3StateDictAdapter.from_model)
)

__all__ = [
    "DEEPSEEK_V3_VOCAB_SIZE",
    "DeepseekV3StateDictAdapter",
    "FAMILY",
    "KIMI_VOCAB_SIZE",
    "MUON_PARAMS",
    "ModelArgs",
    "SPEC",
    "Transformer",
    "build_block",
    "build_model",
    "deepseek_v3_configs",
    "get_model_args",
    "get_nparams_and_flops",
]
