"""One global grad norm over DMuon's owner grads and FSDP2's sharded grads.

No host sync: the norm stays a device tensor, every grad is scaled by the clip coefficient as a tensor (never a
Python number, whose `.item()` would wait for the GPU), and the collectives (the all-reduce of the owners' sum,
DTensor's norm reductions) are ordered on the device, not waited for by the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .state import state_of, unwrap


def _dtensor_sq_norm(grads: list[DTensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of DTensor grads, exact for any placement (FSDP2's `_StridedShard` over TP included):
    DTensor's own norm per mesh, materialized with `full_tensor()`."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_mesh: dict[int, list[DTensor]] = {}
    for g in grads:
        by_mesh.setdefault(id(g.device_mesh), []).append(g)
    for same_mesh in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(same_mesh, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = total + norm.float().to(device).pow(2)
    return total


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip every grad of `model` by one global L2 norm; returns that norm (same value on every rank).

    Dedicated matrices count once, on their global owner (`_reduced_grad`); FSDP2/TP grads count through
    their DTensor shards; plain replicated grads count once.
    """
    if norm_type != 2.0:
        raise ValueError("dmuon.clip_grad_norm_ supports the L2 norm only")
    state = state_of(model, "clip_grad_norm_")
    model = unwrap(model)
    owned = [g for dp in state.dparams if dp.is_owner and (g := dp.reduced_grad()) is not None]
    device = next(model.parameters()).device
    ded_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in owned:
        ded_sq += g.float().pow(2).sum()
    dist.all_reduce(ded_sq)
    others = [p.grad for p in model.parameters() if p not in state.by_param and p.grad is not None]
    dt = [g for g in others if isinstance(g, DTensor)]
    plain = [g for g in others if not isinstance(g, DTensor)]
    total_sq = ded_sq + _dtensor_sq_norm(dt, device)
    for g in plain:
        total_sq += g.float().pow(2).sum()
    total = total_sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # A DTensor grad is scaled through its local tensor, right for every placement: Shard / _StridedShard /
    # Replicate hold parts or copies of the grad, and a Partial one (a sum or an average of the ranks' locals)
    # scales with each local once. The coefficient stays fp32 (torch's clip_grads_with_norm_ does the same).
    _scale_(owned + [g.to_local() if isinstance(g, DTensor) else g for g in others], coef)
    return total


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim tensor `coef`: one foreach call per device, no host sync
    (on the device `coef` lives on; a grad offloaded to the CPU takes one copy of it)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, same_device in by_device.items():
        torch._foreach_mul_(same_device, coef.to(device))
