"""The DDP paths' other params: `dmuon.replicate` (DDP for the params DMuon does not own: one start for all
ranks, grads averaged after each backward) and the marking that lets torch's own DistributedDataParallel
take that role instead.

`replicate` packs the grads into one flat buffer and all-reduces it (AVG) once at the end of backward: one
coalesced collective per step, which is what DDP's bucketing amounts to for small models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .param import local_of

_ATTR = "_dmuon_replicate"


class _GradSync:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params, self.group = params, group
        self.sync_grads = True
        self._queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _p: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce)

    @torch.no_grad()
    def _all_reduce(self) -> None:
        self._queued = False
        for p in self.params:  # a TP param's grad may come back Partial: give it the param's layout first
            if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local_of(p.grad) for p in self.params if p.grad is not None]  # TP: the local shards
        if not self.sync_grads or not grads or dist.get_world_size(self.group) == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def replicate_params(model: nn.Module, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("replicate was already called on this model")
    with torch.no_grad():  # DDP semantics: every replica starts from rank 0's values
        for p in params:
            dist.broadcast(local_of(p.data), src=dist.get_global_rank(group, 0), group=group)
    setattr(model, _ATTR, _GradSync(params, group))


@contextlib.contextmanager
def replicate_no_sync(model: nn.Module) -> Iterator[None]:
    """`replicate`'s all-reduce off inside the block (nothing to do for a model without `replicate`)."""
    sync = getattr(model, _ATTR, None)
    if sync is None:
        yield
        return
    prev, sync.sync_grads = sync.sync_grads, False
    try:
        yield
    finally:
        sync.sync_grads = prev


def ignore_in_torch_ddp(model: nn.Module, names: list[str]) -> None:
    """Have a later `DistributedDataParallel(model)` leave the dedicated params `names` (FQNs in `model`) to
    DMuon: no rank-0 broadcast at wrap time, no bucket, no all-reduce. torch's documented hook for this is
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`; names already marked are kept."""
    marked = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, marked + [n for n in names if n not in marked]
    )
