"""One global grad norm over DMuon's owner grads and FSDP2's sharded grads."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .api import _require_state


def _dtensor_sq_norm(grads: list[DTensor]) -> torch.Tensor:
    """Sum of squares of DTensor grads: local sums, all-reduced over each mesh dim they are sharded on."""
    total = torch.zeros((), dtype=torch.float32)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    meshes = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements))
        meshes[key] = g.device_mesh
        buckets.setdefault(key, []).append(g.to_local())
    for key, locals_ in buckets.items():
        mesh, placements = meshes[key], key[1]
        sq = torch.stack([t.float().pow(2).sum() for t in locals_]).sum()
        for dim, pl in enumerate(placements):
            if isinstance(pl, Shard):
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total.to(sq.device) + sq
    return total


def clip_grad_norm_(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip every grad of `model` by one global L2 norm; returns that norm (same value on every rank).

    Dedicated matrices count once, on their global owner (`_reduced_grad`); FSDP2/TP grads count through
    their DTensor shards; plain replicated grads count once.
    """
    if norm_type != 2.0:
        raise ValueError("dmuon.clip_grad_norm_ supports the L2 norm only")
    state = _require_state(model, "clip_grad_norm_")
    owned = [dp._reduced_grad for dp in state.dparams if dp.is_owner and dp._reduced_grad is not None]
    device = next(model.parameters()).device
    ded_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in owned:
        ded_sq += g.float().pow(2).sum()
    dist.all_reduce(ded_sq)
    others = [p.grad for p in model.parameters() if p not in state.by_param and p.grad is not None]
    dt = [g for g in others if isinstance(g, DTensor)]
    plain = [g for g in others if not isinstance(g, DTensor)]
    total_sq = ded_sq + _dtensor_sq_norm(dt).to(device)
    for g in plain:
        total_sq += g.float().pow(2).sum()
    total = total_sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in owned:
        g.mul_(coef)
    for g in others:
        g.mul_(coef.to(g.dtype) if not isinstance(g, DTensor) else coef.item())
    return total
