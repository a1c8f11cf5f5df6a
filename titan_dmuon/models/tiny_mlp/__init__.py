"""The TinyMLP family: the quick-start TinyMLP (examples/quickstart.py, scripts/bench_step.py, the tests) and
the token-level TinyMLPLM, registered as model family "tiny_mlp" (no TP plan)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titan_dmuon.components.model import ModelSpec, register_model_spec

from .model import Block, TinyMLP, TinyMLPArgs, TinyMLPLM, is_muon_target

tiny_mlp_configs: dict[str, TinyMLPArgs] = {
    "debugmodel": TinyMLPArgs(dim=256, ff=1024, n_layers=4),
    "tinymodel": TinyMLPArgs(dim=64, ff=256, n_layers=2),
}


def build_model(
    flavor: str, vocab_size: int | None = None, device: torch.device | str = "meta", max_seq_len: int | None = None
) -> TinyMLPLM:
    """A flavor of TinyMLPLM on `device` (on "meta": nothing allocated; `init_weights` after `to_empty`).
    `max_seq_len` is accepted and unused: the model has no positions."""
    if flavor not in tiny_mlp_configs:
        raise ValueError(f"unknown tiny_mlp flavor {flavor!r}; choose one of {sorted(tiny_mlp_configs)}")
    args = dataclasses.replace(tiny_mlp_configs[flavor])
    if vocab_size is not None:
        args.vocab_size = vocab_size
    with torch.device("meta"):
        model = TinyMLPLM(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def get_nparams_and_flops(model: TinyMLPLM, seq_len: int) -> tuple[int, int]:
    """(params, training FLOPs per token): 6 x the non-embedding params (no attention)."""
    return model.num_params(), 6 * model.num_params(exclude_embedding=True)


def blocks(model: TinyMLPLM) -> list[tuple[str, nn.Module]]:
    return [(f"layers.{i}", block) for i, block in enumerate(model.layers)]


MUON_PARAMS = r"^layers\.\d+\.(gate|up|down)_proj\.weight$"

SPEC = register_model_spec(
    ModelSpec(
        name="tiny_mlp",
        flavors=tiny_mlp_configs,
        build=build_model,
        nparams_and_flops=get_nparams_and_flops,
        blocks=blocks,
        muon_params=MUON_PARAMS,
        param_inits=lambda model: model.param_inits(),
        init_buffers=lambda model, device: None,  # no buffers
    )
)

__all__ = [
    "MUON_PARAMS",
    "SPEC",
    "Block",
    "TinyMLP",
    "TinyMLPArgs",
    "TinyMLPLM",
    "blocks",
    "build_model",
    "get_nparams_and_flops",
    "is_muon_target",
    "tiny_mlp_configs",
]
