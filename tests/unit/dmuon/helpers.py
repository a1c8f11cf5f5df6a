"""Tiny models and meshes for the dmuon unit tests (one gloo rank: see conftest.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.tiny_models import TinyMLP, batch, proj_predicate

D, FF, LAYERS, B = 8, 16, 2, 4
DEDICATED = [f"layers.{i}.{n}_proj.weight" for i in range(LAYERS) for n in ("down", "gate", "up")]


def tiny() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP(D, FF, LAYERS)


def x(step: int = 0) -> torch.Tensor:
    return batch(step, 0, B, D)


def mesh1(name: str | None = None):
    """A 1-rank DeviceMesh, named `name` when given."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=(name,) if name else None)


def dedicated(model: nn.Module, reshard_after_forward: bool = True) -> tuple[nn.Module, nn.Module]:
    """(a plain copy of `model` taken first, `model` with its proj matrices dedicated on one rank)."""
    from titan_dmuon import dmuon

    plain = copy.deepcopy(model)
    dmuon.dedicate_params(model, mesh1(), proj_predicate, reshard_after_forward=reshard_after_forward)
    return plain, model


def torch_ddp(model: nn.Module) -> nn.Module:
    """dedicate_params_ddp on one rank, then torch's DistributedDataParallel around the model."""
    from torch.nn.parallel import DistributedDataParallel

    from titan_dmuon import dmuon

    dmuon.dedicate_params_ddp(model, mesh1("dp"), proj_predicate)
    return DistributedDataParallel(model)
