"""Llama-3 model family: flavors (published Llama 3 / 3.1 / 3.2 sizes), builder, TP plan, and its ModelSpec
(registered as "llama3" when this package is imported)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titan_dmuon.components.model import ModelSpec, register_model_spec

from .memory import ActivationEstimate, activation_estimate
from .model import ModelArgs, Transformer, TransformerBlock, get_nparams_and_flops
from .state_dict_adapter import Llama3StateDictAdapter
from .tensor_parallel import apply_tp

LLAMA3_VOCAB_SIZE = 128256

llama3_configs: dict[str, ModelArgs] = {
    # Sized for a laptop CPU; vocab_size comes from the tokenizer (build_model's vocab_size).
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000),
    # For multi-rank end-to-end tests on a few CPU cores: 2 blocks, 4 heads (TP 2 and 4 divide it).
    "tinymodel": ModelArgs(dim=64, n_layers=2, n_heads=4, multiple_of=32, rope_theta=500000),
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_theta=500000,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
    ),
}


def get_model_args(flavor: str, vocab_size: int | None = None, **overrides) -> ModelArgs:
    """A fresh copy of a flavor's ModelArgs; ``vocab_size`` (if given) and ``overrides`` replace fields."""
    if flavor not in llama3_configs:
        raise ValueError(f"unknown llama3 flavor {flavor!r}; choose one of {sorted(llama3_configs)}")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return dataclasses.replace(llama3_configs[flavor], **overrides)


def build_model(
    flavor: str, vocab_size: int | None = None, device: torch.device | str = "meta", **overrides
) -> Transformer:
    """Build a flavor on ``device``. On "meta" nothing is allocated or initialized (the trainer parallelizes it,
    then each rank materializes and initializes its share); on a real device it is materialized with
    ``to_empty`` and ``init_weights`` (the seed of ``torch.manual_seed``), the weights a run with that seed
    starts from on any cluster shape.

    ``vocab_size`` is required for "debugmodel" and "tinymodel"; ``overrides`` (e.g. ``max_seq_len=...``)
    replace ModelArgs fields.
    """
    args = get_model_args(flavor, vocab_size, **overrides)
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def blocks(model: Transformer) -> list[tuple[str, nn.Module]]:
    """The transformer blocks, `layers.N`, in forward order."""
    return [(f"layers.{name}", block) for name, block in model.layers.items()]


def head_blocks(model: Transformer) -> dict[str, tuple[int, int]]:
    """Per-head Muon's blocks: each attention head of every block, `(0, head_dim)` for the rows of wq/wk/wv (one
    query or kv head each) and `(1, head_dim)` for the columns of wo (its input is the heads, concatenated)."""
    hd = model.args.head_dim
    out: dict[str, tuple[int, int]] = {}
    for name, _ in blocks(model):
        for proj in ("wq", "wk", "wv"):
            out[f"{name}.attention.{proj}.weight"] = (0, hd)
        out[f"{name}.attention.wo.weight"] = (1, hd)
    return out


# Muon takes the attention and feed-forward matrices of every block; embeddings, norms and the output use AdamW.
MUON_PARAMS = r"^layers\.\d+\.(attention|feed_forward)\.\w+\.weight$"

SPEC = register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3_configs,
        build=build_model,
        nparams_and_flops=get_nparams_and_flops,
        blocks=blocks,
        muon_params=MUON_PARAMS,
        param_inits=lambda model: model.param_inits(),
        init_buffers=lambda model, device: model.init_buffers(device),
        apply_tp=apply_tp,
        activation_estimate=activation_estimate,
        head_blocks=head_blocks,
        state_dict_adapter=Llama3StateDictAdapter.from_model,
    )
)


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
    "MUON_PARAMS",
    "SPEC",
    "blocks",
    "head_blocks",
]
