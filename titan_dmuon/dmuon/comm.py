"""DMuon's collectives: one coalesced helper per collective kind, async handles, and the byte ledger.

On NCCL a batch of broadcasts/reduces is issued as one coalesced call (`dist._coalescing_manager`); gloo has
no coalesced broadcast/reduce, so each op is issued async and the batch is a list of work handles. Every
op is recorded in a `CommLedger` (docs/dmuon.md, "Bytes per step"): a broadcast/reduce/gather/scatter of P
elements over N ranks moves (N-1)/N·P elements per rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Ledger kinds, in reporting order.
KINDS = ("broadcast", "reduce", "replicate_reduce", "replicate_broadcast", "tp_gather", "tp_scatter", "tp_gram")


@dataclass
class CommLedger:
    """Elements and bytes each DMuon collective kind moved on this rank, per optimizer step."""

    current: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    current_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    last_step: dict[str, float] = field(default_factory=dict)
    last_step_bytes: dict[str, float] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, numel: int, group_size: int, element_size: int, factor: int = 1) -> None:
        """`factor=2` for an all-reduce (a ring moves 2(N-1)/N·P per rank)."""
        if kind not in KINDS:
            raise ValueError(f"unknown ledger kind {kind!r}")
        share = factor * (group_size - 1) / group_size * numel
        self.current[kind] += share
        self.current_bytes[kind] += share * element_size
        self.ops[kind] += 1

    def end_step(self) -> None:
        """Close the step: what moved since the last `end_step` becomes `last_step`."""
        self.last_step = {k: float(self.current.get(k, 0.0)) for k in KINDS}
        self.last_step_bytes = {k: float(self.current_bytes.get(k, 0.0)) for k in KINDS}
        self.current = defaultdict(float)
        self.current_bytes = defaultdict(float)


class Work:
    """A batch of async collectives; `wait()` is idempotent."""

    def __init__(self, works: Sequence | None = None):
        self._works = [w for w in (works or []) if w is not None]

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()

    def merge(self, other: Work) -> Work:
        return Work(self._works + other._works)

    def is_pending(self) -> bool:
        return bool(self._works)


def _coalesce(group: dist.ProcessGroup, device: torch.device, issue) -> Work:
    """Issue `issue()`'s ops as one coalesced NCCL call, or as separate async gloo ops."""
    if device.type == "cuda":
        with dist._coalescing_manager(group=group, device=device, async_ops=True) as cm:
            issue(async_op=False)
        return Work([cm])
    return Work(issue(async_op=True))


def _rooted_coalesced(
    tensors: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
    ledger: CommLedger | None,
    kind: str,
    op,
) -> Work:
    """Issue `op(tensor, root, group, async_op)` for each (tensor, root global rank) as one coalesced batch,
    recording each in the ledger. `group=None` stands for a group of this rank alone (DDP's shard axis): a
    no-op, like any 1-rank group."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not tensors:
        return Work()
    if ledger is not None:
        for t, _ in tensors:
            ledger.record(kind, t.numel(), size, t.element_size())

    def issue(async_op: bool):
        return [op(t, root, group, async_op) for t, root in tensors]

    return _coalesce(group, tensors[0][0].device, issue)


def broadcast_coalesced(
    tensors: Sequence[tuple[torch.Tensor, int]], group: dist.ProcessGroup | None, ledger: CommLedger | None, kind: str
) -> Work:
    """Broadcast each (tensor, src global rank) over `group`; one coalesced call."""
    return _rooted_coalesced(
        tensors, group, ledger, kind, lambda t, src, g, a: dist.broadcast(t, src=src, group=g, async_op=a)
    )


def reduce_coalesced(
    tensors: Sequence[tuple[torch.Tensor, int]], group: dist.ProcessGroup | None, ledger: CommLedger | None, kind: str
) -> Work:
    """Average each (tensor, dst global rank) over `group` onto dst; one coalesced call.

    gloo leaves partial sums in the non-destination buffers: callers must not read them afterwards.
    """
    return _rooted_coalesced(
        tensors,
        group,
        ledger,
        kind,
        lambda t, dst, g, a: dist.reduce(t, dst=dst, op=dist.ReduceOp.AVG, group=g, async_op=a),
    )


def group_rank_to_global(group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)
