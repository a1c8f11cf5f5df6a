"""The one materialization step after `parallelize` (which runs on the meta device): each rank allocates only
what it holds and fills it with its topology-invariant initial values (titan_dmuon/init.py).

What a rank holds: its FSDP2 shards (over TP: of its TP shard; `_StridedShard` rows included), the params the
optimizer component keeps itself (DMuon: the fp32 masters of this rank's owner column, through
`dmuon.init_dedicated_params`), and the buffers. The values of every entry are a function of (seed, FQN,
position), so a run starts from the same weights on any cluster shape. No rank allocates a tensor it does not
hold; the scratch is one init tile at a time.

    model = parallelize(build_meta_model(cfg, spec, vocab), dims, mesh, cfg, spec, optimizer)   # meta
    materialize(model, spec, optimizer, device, seed)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan_dmuon.init import fill_, full_index

if TYPE_CHECKING:
    from titan_dmuon.components.model import ModelSpec
    from titan_dmuon.components.optimizer import OptimizerComponent


def global_index(p: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, the global positions this rank's local tensor of `p` holds (ascending).

    A DTensor's sharding of one tensor dim does not depend on the other dims, so each dim's positions are
    those a 1D DTensor of `arange(size)` with the same placements (this dim's shards, Replicate elsewhere)
    keeps locally: torch's own splitting, `_StridedShard` (FSDP2 over TP) included, with no communication.
    """
    if not isinstance(p, DTensor):
        return full_index(p.shape, p.device)
    index = []
    for dim, size in enumerate(p.shape):
        placements = [_on_dim(pl, dim) for pl in p.placements]
        positions = torch.arange(size, device=p.to_local().device)
        if all(isinstance(pl, Replicate) for pl in placements):
            index.append(positions)
            continue
        index.append(distribute_tensor(positions, p.device_mesh, placements, src_data_rank=None).to_local())
    return index


def _on_dim(placement, dim: int):
    """`placement` as it acts on a 1D tensor of tensor dim `dim`'s positions."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    return Replicate()  # Replicate, or Partial (a param is never partial)


@contextlib.contextmanager
def _without(model: nn.Module, params: set[nn.Parameter]) -> Iterator[None]:
    """Take `params` out of their modules for the block (so `to_empty` neither allocates nor replaces them),
    then put them back in their original order."""
    saved = []
    for module in model.modules():
        if any(p in params for p in module._parameters.values() if p is not None):
            saved.append((module, list(module._parameters.items())))
            for key in [k for k, p in module._parameters.items() if p is not None and p in params]:
                del module._parameters[key]
    try:
        yield
    finally:
        for module, items in saved:
            module._parameters.clear()
            module._parameters.update(items)


@torch.no_grad()
def materialize(
    model: nn.Module, spec: ModelSpec, optimizer: OptimizerComponent, device: torch.device, seed: int
) -> None:
    """Allocate this rank's share of the parallelized meta `model` on `device` and initialize it from
    `spec.param_inits` with `seed`; then `spec.init_buffers`."""
    inits = spec.param_inits(model)
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}  # global shapes (DTensor: logical)
    missing = sorted(set(shapes) - set(inits))
    if missing:
        raise KeyError(f"{spec.name}'s param_inits has no entry for {missing[:5]}: every parameter needs one")
    own = optimizer.own_params
    with _without(model, own):
        model.to_empty(device=device)  # FSDP2 shards, plain params and buffers; not the optimizer's own

    def init_fn(fqn: str, out: torch.Tensor, region: tuple[slice, ...]) -> None:
        index = [torch.arange(s.start, s.stop, device=out.device) for s in region]
        fill_(out, inits[fqn], seed, fqn, shapes[fqn], index)

    optimizer.init_own_params(init_fn, device)
    for fqn, p in model.named_parameters():
        if p in own:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        fill_(local, inits[fqn], seed, fqn, shapes[fqn], global_index(p))
    spec.init_buffers(model, device)


__all__ = ["global_index", "materialize"]
