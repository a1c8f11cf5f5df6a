"""One global grad norm over DMuon's owner grads and FSDP2's sharded grads.

No host sync: the norm stays a device tensor, every grad is scaled by the clip coefficient as a tensor (never a
Python number, whose `.item()` would wait for the GPU), and the collectives (the all-reduce of the owners' sum,
DTensor's norm reductions) are ordered on the device, not waited for by the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .state import state_of, unwrap


def grads_sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of grads, exact for any placement (FSDP2's `_StridedShard` over TP included): DTensor's own
    norm per mesh (expert stacks live on another mesh than the dense params), materialized with `full_tensor()`;
    plain grads count as they are (replicated ones once: each rank has the same)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_mesh: dict[DeviceMesh, list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(g)  # by value: FSDP2 builds one mesh object per TP param
        else:
            total = total + g.float().pow(2).sum().to(device)
    for same_mesh in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(same_mesh, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = total + norm.float().to(device).pow(2)
    return total


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip every grad of `model` by one global L2 norm; returns that norm (same value on every rank).

    Dedicated matrices count once, on their global owner (`_reduced_grad`); FSDP2/TP grads count through
    their DTensor shards; plain replicated grads count once. Under tensor parallelism each TP slice is its own copy
    of the DP layout (docs/dmuon.md, "Tensor parallelism"): a TP-sharded matrix's owners hold its shards, but a
    dedicated matrix the TP plan leaves whole (MLA's down projections) has an owner with the whole grad in every
    slice, so each counts 1/T of it (T the slices of one stage). Under a pipeline, `model` is this rank's stages
    and `pp_mesh` the mesh of the ranks holding the other stages: their squared norms are summed over it, so every
    stage clips by the norm of the whole model (the owners' sum is over every rank already).
    """
    if norm_type != 2.0:
        raise ValueError("dmuon.clip_grad_norm_ supports the L2 norm only")
    state = state_of(model, "clip_grad_norm_")
    model = unwrap(model)
    owners = []
    for dp in state.dparams:
        if dp.is_owner:
            dp.sync_cleared()  # the user's clears; not `reduced_grad()`, which would wait for a gather in flight
            if dp._reduced_grad is not None:
                owners.append((dp, dp._reduced_grad))
    # A grad gathered onto its TP owner from the backward takes its clip factor through the gather, which applies
    # it to the gathered matrix, and to the shard once the gather no longer reads it (tp.TPUpdate.rescale).
    gathering = [dp._tp_gather for dp, _ in owners if dp._tp_gather is not None]
    owned = [g for dp, g in owners if dp._tp_gather is None]
    device = next(model.parameters()).device
    stages = pp_mesh.size() if pp_mesh is not None else 1
    ded_sq = torch.zeros((), dtype=torch.float32, device=device)
    for dp, g in owners:
        sq = g.float().pow(2).sum()
        if dp._tp_gather is not None and dp._tp_gather.shard_scale is not None:  # clipped, the factor pending
            sq = sq * dp._tp_gather.shard_scale.to(sq.device).pow(2)
        if dp.shard_dim is None:  # whole in every slice of its stage: the copies of the world's slices
            sq = sq / max(1, dist.get_world_size() // (dp.axes.shard_size * dp.axes.replicate_size * stages))
        ded_sq += sq
    dist.all_reduce(ded_sq)
    others = [p.grad for p in model.parameters() if p not in state.by_param and p.grad is not None]
    others_sq = grads_sq_norm(others, device)
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(others_sq, group=pp_mesh.get_group())
    total = (ded_sq + others_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    scale_grads_(owned + others, coef)
    for gather in gathering:
        gather.rescale(coef)
    return total


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every grad in place by the 0-dim tensor `coef`: one foreach call per device, no host sync
    (on the device `coef` lives on; a grad offloaded to the CPU takes one copy of it).

    A DTensor grad is scaled through its local tensor, right for every placement and whatever its mesh: Shard /
    _StridedShard / Replicate hold parts or copies of the grad, and a Partial one (a sum or an average of the
    ranks' locals) scales with each local once. The coefficient stays fp32 (torch's clip_grads_with_norm_ does
    the same)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        by_device.setdefault(t.device, []).append(t)
    for device, same_device in by_device.items():
        torch._foreach_mul_(same_device, coef.to(device))
