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


def matrix(kind: str, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """fp32 test inputs: "random" Gaussian; "illcond": singular values log-spaced from 1 down to 1e-6;
    "lowrank": a rank-8 component of Frobenius norm 1 plus Gaussian noise of Frobenius norm 1e-2."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(m, n, generator=g)
    s = min(m, n)
    if kind == "illcond":
        u, _ = torch.linalg.qr(torch.randn(m, s, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(n, s, generator=g, dtype=torch.float64))
        return (u @ torch.diag(torch.logspace(0, -6, s, dtype=torch.float64)) @ v.T).float()
    assert kind == "lowrank"
    low = torch.randn(m, 8, generator=g, dtype=torch.float64) @ torch.randn(8, n, generator=g, dtype=torch.float64)
    noise = torch.randn(m, n, generator=g, dtype=torch.float64)
    return (low / low.norm() + 1e-2 * noise / noise.norm()).float()


def rank8_case() -> torch.Tensor:
    """The issue's case: a 256×1024 gradient, a rank-8 component of norm 1 plus noise of norm 1e-2."""
    return matrix("lowrank", 256, 1024, seed=0)
