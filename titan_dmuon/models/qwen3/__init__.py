"""Qwen3 model family, dense and MoE: flavors (the published Qwen3 0.6B to 32B sizes, Qwen3-30B-A3B and
Qwen3-235B-A22B, and CPU-sized ones of each kind), Hugging Face adapter, and its ModelSpec (registered as "qwen3"
when this package is imported). The builder, TP plan, activation estimate and MoE are the shared core's
(titan_dmuon/models/common/)."""

from __future__ import annotations

import dataclasses

from titan_dmuon.components.model import register_model_spec
from titan_dmuon.models.common.memory import activation_estimate
from titan_dmuon.models.common.moe import MoE
from titan_dmuon.models.common.spec import DecoderFamily, blocks, head_blocks
from titan_dmuon.models.common.tensor_parallel import apply_tp

from .model import ModelArgs, Transformer, TransformerBlock, get_nparams_and_flops
from .state_dict_adapter import Qwen3StateDictAdapter

QWEN3_VOCAB_SIZE = 151936


def _published(dim: int, n_layers: int, n_heads: int, ffn: int, tie: bool) -> ModelArgs:
    """A published Qwen3 size: 8 kv heads of 128, RoPE theta 1e6, RMSNorm eps 1e-6, the Qwen vocabulary."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        ffn_hidden_dim=ffn,
        vocab_size=QWEN3_VOCAB_SIZE,
        rope_theta=1000000.0,
        tie_embeddings=tie,
    )


def _published_moe(dim: int, n_layers: int, n_heads: int, ffn: int, moe_ffn: int) -> ModelArgs:
    """A published Qwen3-MoE size (Qwen/Qwen3-<size> config.json): 4 kv heads of 128, 128 experts of which 8 per
    token with renormalized weights, every layer sparse, untied, RoPE theta 1e6, the Qwen vocabulary."""
    dense = _published(dim, n_layers, n_heads, ffn, tie=False)
    return dataclasses.replace(
        dense, n_kv_heads=4, num_experts=128, top_k=8, moe_hidden_dim=moe_ffn, norm_topk_prob=True
    )


# Sized for a laptop CPU; vocab_size comes from the tokenizer (build_model's vocab_size). head_dim 64 with 8 heads:
# the attention is 512 wide on a 256-wide residual stream, as Qwen3's is twice its dim.
_DEBUG = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden_dim=768, tie_embeddings=True)
# For multi-rank end-to-end tests on a few CPU cores: 2 blocks, 4 heads, 2 kv heads (TP 2 divides both), tied
# (`tie_embeddings=False` as an override gives the untied variant).
_TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=192, tie_embeddings=True)

qwen3_configs: dict[str, ModelArgs] = {
    "debugmodel": _DEBUG,
    "tinymodel": _TINY,
    # The published sizes (Qwen/Qwen3-<size> config.json): the three small ones tie their embeddings.
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, ffn=3072, tie=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, ffn=6144, tie=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, ffn=9728, tie=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, ffn=12288, tie=False),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, ffn=17408, tie=False),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, ffn=25600, tie=False),
    # MoE: debugmodel's and tinymodel's attention with every feed-forward an MoE of 8 experts, 2 per token
    # (tinymodel_moe: 4 CPU steps in seconds; 8 experts split over 2, 4 or 8 expert-parallel ranks).
    "debugmodel_moe": dataclasses.replace(_DEBUG, num_experts=8, top_k=2, moe_hidden_dim=128),
    "tinymodel_moe": dataclasses.replace(_TINY, num_experts=8, top_k=2, moe_hidden_dim=32),
    # The published MoE sizes (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json); ffn is the
    # intermediate_size a dense layer would have (mlp_only_layers is empty: none is).
    "30B-A3B": _published_moe(dim=2048, n_layers=48, n_heads=32, ffn=6144, moe_ffn=768),
    "235B-A22B": _published_moe(dim=4096, n_layers=94, n_heads=64, ffn=12288, moe_ffn=1536),
}


FAMILY = DecoderFamily("qwen3", qwen3_configs, Transformer)
get_model_args = FAMILY.get_model_args
build_model = FAMILY.build_model  # overrides such as tie_embeddings=False give a flavor's other variant


# Muon takes the blocks' projection matrices only: never the q/k norms (1D), the block norms, the embedding, the
# output head, or the matrix they share when tied (whose FQN is tok_embeddings.weight). MoE layers: the experts'
# 3-D params (one matrix per expert), never the router's gate (AdamW): an E x dim matrix with E much smaller than
# dim, whose orthogonalized update has E unit singular values, i.e. every expert's row moves by the same norm
# however much or little its gradient says: a poor fit for a router.
MUON_PARAMS = (
    r"^layers\.\d+\.(attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))\.weight$"
    r"|^layers\.\d+\.feed_forward\.experts\.(w1|w2|w3)$"
)

SPEC = register_model_spec(
    FAMILY.spec(
        muon_params=MUON_PARAMS,
        state_dict_adapter=Qwen3StateDictAdapter.from_model,
    )
)


__all__ = [
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "qwen3_configs",
    "get_model_args",
    "build_model",
    "activation_estimate",
    "apply_tp",
    "get_nparams_and_flops",
    "QWEN3_VOCAB_SIZE",
    "Qwen3StateDictAdapter",
    "MUON_PARAMS",
    "FAMILY",
    "SPEC",
    "blocks",
    "head_blocks",
    "MoE",
]
