"""What a forward leaves alive for its backward, counted without the code under test: every tensor an op creates
during the forward is recorded (by storage, through a dispatch mode); what is still alive once the forward's
Python references are dropped is held by the autograd graph, by activation checkpointing (its inputs, the outputs
op-level selective AC keeps) or by nothing else. Parameters and buffers, created before, are never counted.

`torch.autograd.graph.saved_tensors_hooks` alone cannot see inside a checkpointed region (the checkpoint installs
its own hooks there); for a region without AC both counts agree (`saved_tensor_bytes`), which tests the counter.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _Created(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _local(t).untyped_storage()
                self.storages.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return out


def module_storages(*modules: torch.nn.Module) -> set[int]:
    """The storages (`_cdata`) of the modules' params and buffers: a view of one (a transposed weight, a slice of
    the RoPE table) is no activation."""
    return {_local(t).untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())}


def held_bytes(forward: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[torch.Tensor, int]:
    """Run `forward` (which builds its input inside, from a leaf, and returns a scalar loss) and return (the loss,
    the bytes of every storage an op made during it, but those in `exclude`, still alive once only the loss is
    kept)."""
    mode = _Created()
    with mode:
        loss = forward()
    loss_storage = _local(loss).untyped_storage()._cdata

    def count() -> int:
        alive = [n for c, (ref, n) in mode.storages.items() if not ref.expired() and c not in exclude]
        return sum(alive) - (mode.storages[loss_storage][1] if loss_storage in mode.storages else 0)

    # A collective's buffers (e.g. the all-gathered logits without loss parallel) can outlive the forward for a
    # moment, held by the process group's work objects until their thread lets go of them: the least of a few
    # counts, each after the ranks are past a barrier, is what the graph itself keeps.
    # One full collection frees what only cycles held (a second of CPU per call on a process that imported torch:
    # once); the collective buffers are then freed by reference counts as the threads let go.
    gc.collect()
    held = count()
    if dist.is_initialized():
        for _ in range(5):
            dist.barrier()
            time.sleep(0.05)
            held = min(held, count())
    return loss, held


def saved_tensor_bytes(forward: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[torch.Tensor, int]:
    """The bytes of the distinct storages autograd saves for backward during `forward`, but those in `exclude`
    (the `_cdata` of the params' and buffers' storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _local(t).untyped_storage()
        if st._cdata not in exclude:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return loss, sum(seen.values())
