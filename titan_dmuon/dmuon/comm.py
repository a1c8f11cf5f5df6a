"""DMuon's collectives: one coalesced helper per collective kind, async handles, the streams they are issued
on, the publish-wait meter and the byte ledger.

Every collective is issued async (`async_op=True`) and waited where its buffer is consumed. On NCCL a batch of
broadcasts/reduces is one coalesced call (`dist._coalescing_manager(async_ops=True)`, each op inside it also
`async_op=True`: ProcessGroupNCCL runs an `async_op=False` op on the caller's current stream, and a coalesced
batch whose ops are sync returns no work, so the batch would serialize with compute); gloo has no coalesced
broadcast/reduce, so each op is issued async and the batch is a list of work handles. On CUDA the ops are
issued from DMuon's dedicated streams (`CudaStreams`; docs/dmuon.md, "CUDA streams"); on CPU `Streams`
does nothing. Every op is recorded in a `CommLedger` (docs/dmuon.md, "Bytes per step"): a
broadcast/reduce/gather/scatter of P elements over N ranks moves (N-1)/N·P elements per rank
(`costs.collective_elements`, the cost model's statement of it).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .costs import KINDS, collective_elements


@dataclass
class CommLedger:
    """Elements and bytes each DMuon collective kind moved on this rank, per optimizer step."""

    current: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    current_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    last_step: dict[str, float] = field(default_factory=dict)
    last_step_bytes: dict[str, float] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, numel: int, group_size: int, element_size: int, factor: int = 1) -> None:
        """`factor=2` (costs.ALL_REDUCE) for an all-reduce (a ring moves 2(N-1)/N·P per rank)."""
        if kind not in KINDS:
            raise ValueError(f"unknown ledger kind {kind!r}")
        share = collective_elements(numel, group_size, factor)
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
    """A batch of async collectives (or CUDA events); `wait()` is idempotent. On gloo `wait()` blocks this thread
    until the ops are done; on NCCL it makes the current stream wait for them (the CPU goes on)."""

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


# The stream each kind is issued from (docs/dmuon.md, "CUDA streams"): the shard axis on the two high-priority
# streams; the replicate axis (stage-2 reduce, publish) on a default-priority one (FSDP2's split between its
# all-gather / reduce-scatter streams and its all-reduce stream); the TP gather of an update in `step()` with the
# reduces, the TP gather of a reduced grad from the backward on the replicate-axis stream that accumulated it (so the
# reduce stream never waits for that axis), the TP scatter, whose result the next forward consumes, with the publish.
STREAM_OF = {
    "broadcast": "broadcast",
    "reduce": "reduce",
    "replicate_reduce": "replicate_broadcast",
    "replicate_broadcast": "replicate_broadcast",
    "tp_gather": "reduce",
    "tp_grad_gather": "replicate_broadcast",
    "tp_scatter": "replicate_broadcast",
}


class Streams:
    """DMuon's streams on a device without them (CPU/gloo): every method is a no-op, so the CPU path is the
    stream-free code. `CudaStreams` is the CUDA one; a test may put a stand-in on `DMuonState.streams`.

    The contract callers follow: enter `use(name)` to write a buffer for, and issue, a collective on stream
    `name` (the stream first waits for the compute stream's queued work: its inputs); `hold(t)` every tensor
    that stream touches but the compute stream allocated (the caching allocator must not hand its memory out
    again before the stream is done with it); wait on the `Work` on the stream that consumes the result."""

    names = ("broadcast", "reduce", "replicate_broadcast")

    def use(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def hold(self, *tensors: torch.Tensor) -> None:
        pass

    def event(self):
        """An event recorded on the current stream now (it quacks like a work handle: `wait()`); None on CPU."""
        return None

    def timed_wait(self, work: Work):
        """`work.wait()`, returning how long it held this thread (CPU) or the current stream (CUDA, resolved
        later by `resolve`)."""
        t0 = time.perf_counter()
        work.wait()
        return time.perf_counter() - t0

    @staticmethod
    def resolve(sample) -> float:
        return float(sample)


# Debugging only (scripts/gpu_check.sh sets it under the CUDA sanitizer): a side stream entered through
# `CudaStreams.use` first spins this many GPU cycles (`torch.cuda._sleep`), so that its collectives land late and a
# missing wait, event or hold shows as a race (wrong numbers, or the sanitizer's report) instead of hiding behind
# the side stream being quick. Unset or 0: off. Read when the streams are made.
SLOW_STREAMS_ENV = "DMUON_DEBUG_SLOW_STREAMS_CYCLES"


def slow_streams_cycles() -> int:
    """The cycles of `SLOW_STREAMS_ENV` (0 when unset); a value that is not a non-negative integer is an error."""
    raw = os.environ.get(SLOW_STREAMS_ENV, "").strip()
    if not raw:
        return 0
    try:
        cycles = int(raw)
    except ValueError:
        cycles = -1
    if cycles < 0:
        raise ValueError(f"{SLOW_STREAMS_ENV}={raw!r}: give a number of GPU cycles (an integer >= 0)")
    return cycles


class CudaStreams(Streams):
    """The dedicated CUDA streams: `broadcast` and `reduce` at high priority (-1), `replicate_broadcast` at the
    default priority (0)."""

    PRIORITY = {"broadcast": -1, "reduce": -1, "replicate_broadcast": 0}

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {n: torch.cuda.Stream(device, priority=p) for n, p in self.PRIORITY.items()}
        self.slow_cycles = slow_streams_cycles()
        # torch.cuda._sleep is private (scripts/gpu_check_api.py lists it): without it the debug delay is off
        self._sleep = getattr(torch.cuda, "_sleep", None) if self.slow_cycles else None

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffers compute wrote are ready
        with torch.cuda.stream(stream):
            if self._sleep is not None:
                self._sleep(self.slow_cycles)  # SLOW_STREAMS_ENV: this stream's next ops start late
            yield

    def hold(self, *tensors: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        for t in tensors:
            if t is not None and t.is_cuda and t.untyped_storage().size():
                t.record_stream(stream)

    def event(self):
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def timed_wait(self, work: Work):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work.wait()
        end.record()
        return start, end

    @staticmethod
    def resolve(sample) -> float:
        if isinstance(sample, tuple):
            start, end = sample
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return float(sample)


def streams_for(device: torch.device) -> Streams:
    """DMuon's streams on `device`: the CUDA ones there, the no-op ones anywhere else."""
    return CudaStreams(device) if device.type == "cuda" else Streams()


class WaitMeter:
    """How long the next forward waited for each group's post-step publish (the HSDP/DDP replicate-axis
    broadcast): samples since the last `summary()`, in the streams' units (see `Streams.timed_wait`), the last
    `MAX_SAMPLES` of them (a run that never asks keeps a bounded number of CUDA events)."""

    QUANTILES = (50, 90, 99)
    MAX_SAMPLES = 8192

    def __init__(self):
        self.samples: collections.deque = collections.deque(maxlen=self.MAX_SAMPLES)

    def add(self, sample) -> None:
        self.samples.append(sample)

    def summary(self, streams: Streams) -> dict[str, float]:
        """p50/p90/p99 (nearest rank) of the waits since the last call, in microseconds; {} without samples."""
        samples, self.samples = self.samples, collections.deque(maxlen=self.MAX_SAMPLES)
        if not samples:
            return {}
        us = sorted(streams.resolve(s) * 1e6 for s in samples)
        out = {f"publish_wait_p{q}_us": us[max(0, math.ceil(q / 100 * len(us)) - 1)] for q in self.QUANTILES}
        out["publish_waits"] = float(len(us))
        return out


def _coalesce(group: dist.ProcessGroup, device: torch.device, issue) -> Work:
    """Issue `issue()`'s ops async: one coalesced NCCL call, or separate gloo ops."""
    if device.type == "cuda":
        with dist._coalescing_manager(group=group, device=device, async_ops=True) as cm:
            issue(async_op=True)  # async_op=False would run each op on the current stream, and the batch sync
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


# ---- DMuon's own process groups ------------------------------------------------------------------------------
# On NCCL an `async_op=True` collective (each DMuon broadcast/reduce, coalesced or not) runs on the process
# group's own NCCL stream, not the caller's (ProcessGroupNCCL.cpp: `collective` takes `ncclStreams_.at(key)` when
# asyncOp, `endCoalescing` records the batch on it), and `initNCCLComm` takes that stream from the pool at high
# priority only when the group's options say `is_high_priority_stream` (or TORCH_NCCL_HIGH_PRIORITY=1 is set, which
# makes every group's stream high priority). So DMuon's shard axis cannot run at high priority on FSDP2's groups
# (the mesh's): DMuon gets groups of its own, with the mesh groups' ranks, backend and timeout.
#
# How they are made:
# - NCCL with an eagerly initialized default group (init_process_group(device_id=...), this repo's CUDA path):
#   `dist.split_group` of the mesh's own group. Only that group's ranks take part (one ncclCommSplit over the
#   mesh group's communicator); no rank builds another group or a world-sized rank list. `new_group` does not do
#   here: with a bound device `_new_process_group_helper` splits every new NCCL group from the WORLD
#   communicator, a collective every rank must join (non-members through `perform_nocolor_split`), so a group
#   made by its members alone (`use_local_synchronization=True`) hangs, and one made by every rank costs a
#   world-wide split per sibling group.
# - Otherwise (gloo, NCCL initialized lazily): `dist.new_group(ranks, use_local_synchronization=True)`, called by
#   the members only. Its name, the prefix of its store keys, is sha1(ranks, number of groups this rank holds)
#   (`_hash_ranks_to_str`): disjoint sibling groups made at once never share keys, and a second group of the same
#   ranks gets another name. The members must agree on that number, which `_check_agreed_name` checks first (a
#   rank holding one group more would leave the rendezvous waiting until the timeout).


def _device_backends(backend: str) -> set[str]:
    """The backend names a process-group backend string stands for: {"nccl"} for "nccl", {"gloo", "nccl"} for
    "cpu:gloo,cuda:nccl", what torch picks for this machine for "undefined"."""
    name = str(backend).lower()
    if ":" in name or name == _c10d.Backend.UNDEFINED:
        return {str(b) for b in _c10d.BackendConfig(_c10d.Backend(name)).get_device_backend_map().values()}
    return {name}


def _nccl_options(backend: str, *, high_priority: bool, timeout=None, options_cls=None):
    """The `pg_options` for a new group of `backend`: NCCL options asking for a high- (or default-) priority
    stream where an NCCL backend is part of it, else None (gloo takes none). `options_cls` stands in for
    `dist.ProcessGroupNCCL.Options` (absent from a CPU-only torch) in tests."""
    if "nccl" not in _device_backends(backend):
        return None
    cls = options_cls if options_cls is not None else dist.ProcessGroupNCCL.Options
    options = cls(is_high_priority_stream=high_priority)
    if timeout is not None:
        options._timeout = timeout  # new_group warns when the options' timeout and its `timeout` differ
    return options


def _group_timeout(group: dist.ProcessGroup):
    """The collective timeout of `group`'s backend (None where it does not say): the new group inherits it."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None and getattr(options, "_timeout", None) is not None:
            return options._timeout
    return None


def _split_from_parent(uses_nccl: bool) -> bool:
    """Whether the new group must be split from the mesh's group: with TorchComms (new_group cannot make a group
    of its members only there), or on NCCL when the default group is a split source, exactly the predicate
    under which `_new_process_group_helper` would split a new NCCL group from the world communicator."""
    if _torchcomms_enabled():
        return True
    if not uses_nccl:
        return False
    default = _c10d._get_default_group()
    if not default.bound_device_id:
        return False
    split_source = getattr(_c10d, "_get_split_source", None)
    if split_source is not None:
        return split_source(default) is not None
    # A torch without it: its rule inline (the bound device's backend, if that backend can split)
    return bool(getattr(default._get_backend(default.bound_device_id), "supports_splitting", False))


def _torchcomms_enabled() -> bool:
    """`distributed_c10d._use_torchcomms_enabled()` where this torch has it; False on a torch from before TorchComms
    (without the function there is no TorchComms backend to have enabled)."""
    enabled = getattr(_c10d, "_use_torchcomms_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _check_agreed_name(parent: dist.ProcessGroup, ranks: list[int]) -> None:
    """Raise unless every member of `parent` would give the new group the same name (see above)."""
    name = _c10d._hash_ranks_to_str(ranks)
    names: list = [None] * len(ranks)
    dist.all_gather_object(names, name, group=parent)
    if len(set(names)) != 1:
        raise RuntimeError(
            f"dmuon: cannot make a process group of ranks {ranks}: its members hold different numbers of process "
            f"groups ({len(_c10d._world.pg_names)} on global rank {dist.get_rank()}), so torch would name it "
            "differently on each and its rendezvous would wait forever. Create (or destroy) process groups the "
            "same way on every rank of the mesh before dmuon.dedicate_params."
        )


def dedicated_group(mesh, *, high_priority: bool, desc: str | None = None) -> dist.ProcessGroup | None:
    """A new process group, for DMuon alone, with the ranks (in the same order), backend and timeout of the 1D
    DeviceMesh `mesh`'s group; on NCCL its stream is high priority if `high_priority` (the shard axis), default
    priority otherwise (the replicate axis). None for `mesh` None or of one rank (DMuonState's "axis of size 1").

    Every rank of `mesh` must call it at the same point (it is collective over the mesh's group); ranks outside
    the mesh need not call it."""
    if mesh is None:
        return None
    if mesh.ndim != 1:
        raise ValueError(f"dedicated_group needs a 1D mesh, got {mesh.ndim}D with dims {mesh.mesh_dim_names}")
    parent = mesh.get_group()
    ranks = dist.get_process_group_ranks(parent)
    if len(ranks) == 1:
        return None
    backend = str(dist.get_backend(parent))
    timeout = _group_timeout(parent)
    options = _nccl_options(backend, high_priority=high_priority, timeout=timeout)
    if _split_from_parent("nccl" in _device_backends(backend)):
        # Group ranks of the parent, in its order: the new group's rank i is the parent's rank i.
        group = dist.split_group(
            parent_pg=parent,
            split_ranks=[list(range(len(ranks)))],
            timeout=timeout,
            pg_options=options,
            group_desc=desc,
        )
    else:
        if backend != "fake":  # a fake group gathers nothing (the dry-run planner's world of one real rank)
            _check_agreed_name(parent, ranks)
        group = dist.new_group(
            ranks,
            timeout=timeout,
            backend=backend,
            pg_options=options,
            use_local_synchronization=True,
            group_desc=desc,
            sort_ranks=False,
        )
    if group is None or dist.get_process_group_ranks(group) != ranks:
        raise RuntimeError(
            f"dmuon: the process group made for ranks {ranks} has ranks "
            f"{None if group is None else dist.get_process_group_ranks(group)}"
        )
    return group
