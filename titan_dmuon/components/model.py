"""The model registry: one ModelSpec per family, looked up by `model.name` (torchtitan's train spec, smaller).

A family (a package under models/) registers its ModelSpec when imported; `get_model_spec(name)` imports
`models.<name>` on first use. Everything the framework needs to know about a family goes through the spec:
how to build a flavor, where its transformer blocks are (activation checkpointing, compile, FSDP2 and
DMuon's hook boundaries all use them), which matrices are Muon targets by default, its TP plan and its loss.
models/README.md shows how to add a family.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `logits [B, T, V]` against `labels [B, T]`, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@dataclass(frozen=True)
class ModelSpec:
    """What the framework needs to know about a model family.

    The model `build` returns must take `tokens [B, T]` (int64) and return what `loss_fn` takes with the
    labels, and have `init_weights(buffer_device=...)`, which (re)initializes every parameter and buffer in
    place from the RNG state: the trainer builds on meta, materializes with `to_empty`, seeds, then calls it.
    """

    name: str
    """The `model.name` that selects the family."""
    flavors: Mapping[str, Any]
    """Flavor name -> the family's own arguments for it (`model.flavor` picks one)."""
    build: Callable[..., nn.Module]
    """`build(flavor, vocab_size=..., max_seq_len=...)` -> the model on the meta device."""
    nparams_and_flops: Callable[[nn.Module, int], tuple[int, int]]
    """`(model, seq_len)` -> (parameter count, training FLOPs per token), for the log and MFU."""
    blocks: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    """`model` -> its repeated blocks as (FQN, module), in forward order: the units of activation checkpointing,
    compile, FSDP2 sharding and DMuon's broadcast/reduce hooks."""
    muon_params: str
    """Regex over parameter FQNs: the 2D params Muon takes when `optimizer.muon_params` is empty."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    """`(model output, labels)` -> the scalar training loss (a mean, so DP ranks average to the global mean)."""
    apply_tp: Callable[[nn.Module, DeviceMesh], Any] | None = None
    """The tensor-parallel plan, `(model, tp_mesh)`, applied in place; None = the family has none. It raises
    ValueError when the degree does not fit the flavor."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register a family under `spec.name` (a family's package calls this when imported)."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"model family {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def _import_families() -> None:
    """Import every package/module under models/, so each registers its spec."""
    import models

    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"models.{info.name}")


def available_models() -> list[str]:
    """The names of every registered family (importing all of models/ first)."""
    _import_families()
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as `name`, importing `models.<name>` if needed; ValueError lists what exists."""
    if name not in _REGISTRY and name.isidentifier():
        try:
            importlib.import_module(f"models.{name}")
        except ModuleNotFoundError as e:
            if e.name not in ("models", f"models.{name}"):  # the family exists but an import inside it failed
                raise
    if name not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r}; registered families: {', '.join(available_models())}")
    return _REGISTRY[name]


def check_flavor(spec: ModelSpec, flavor: str) -> None:
    """ValueError listing the family's flavors when `flavor` is not one of them."""
    if flavor not in spec.flavors:
        raise ValueError(f"{spec.name} has no flavor {flavor!r}; its flavors: {', '.join(spec.flavors)}")


__all__ = [
    "ModelSpec",
    "available_models",
    "check_flavor",
    "cross_entropy_loss",
    "get_model_spec",
    "register_model_spec",
]
