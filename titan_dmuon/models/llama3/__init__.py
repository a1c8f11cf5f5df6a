"""Llama-3 model family: flavors (published Llama 3 / 3.1 / 3.2 sizes) and its ModelSpec (registered as "llama3"
when this package is imported). The builder, TP plan and activation estimate are the shared core's
(titan_dmuon/models/common/)."""

from __future__ import annotations

from titan_dmuon.components.model import register_model_spec
from titan_dmuon.models.common.memory import ActivationEstimate, activation_estimate
from titan_dmuon.models.common.spec import DecoderFamily, blocks, head_blocks
from titan_dmuon.models.common.tensor_parallel import apply_tp

from .model import ModelArgs, Transformer, TransformerBlock, get_nparams_and_flops
from .state_dict_adapter import Llama3StateDictAdapter

LLAMA3_VOCAB_SIZE = 128256


def _published(**sizes) -> ModelArgs:
    """A published Llama 3 size: 8 kv heads, RoPE theta 500000 (no 3.1 scaling), the Llama 3 vocabulary."""
    return ModelArgs(n_kv_heads=8, vocab_size=LLAMA3_VOCAB_SIZE, rope_theta=500000, **sizes)


llama3_configs: dict[str, ModelArgs] = {
    # Sized for a laptop CPU; vocab_size comes from the tokenizer (build_model's vocab_size).
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000),
    # For multi-rank end-to-end tests on a few CPU cores: 2 blocks, 4 heads (TP 2 and 4 divide it).
    "tinymodel": ModelArgs(dim=64, n_layers=2, n_heads=4, multiple_of=32, rope_theta=500000),
    # grouped-query attention at test size (two query heads per kv head): what QK-clip's GQA rule needs
    "tinymodel_gqa": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, rope_theta=500000),
    "1B": _published(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, multiple_of=256),
    "3B": _published(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0, multiple_of=256),
    "8B": _published(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": _published(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": _published(dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096),
}

FAMILY = DecoderFamily("llama3", llama3_configs, Transformer)
get_model_args = FAMILY.get_model_args
build_model = FAMILY.build_model

# Muon takes the attention and feed-forward matrices of every block; embeddings, norms and the output use AdamW.
MUON_PARAMS = r"^layers\.\d+\.(attention|feed_forward)\.\w+\.weight$"

SPEC = register_model_spec(FAMILY.spec(muon_params=MUON_PARAMS, state_dict_adapter=Llama3StateDictAdapter.from_model))


__all__ = [
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "llama3_configs",
    "get_model_args",
    "build_model",
    "ActivationEstimate",
    "activation_estimate",
    "apply_tp",
    "get_nparams_and_flops",
    "LLAMA3_VOCAB_SIZE",
    "Llama3StateDictAdapter",
    "FAMILY",
    "MUON_PARAMS",
    "SPEC",
    "blocks",
    "head_blocks",
]
