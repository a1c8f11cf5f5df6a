"""DMuonState: what DMuon keeps per model (meshes, groups in forward order, the reduce pipeline, the ledger),
and the one way the rest of the package finds it from a model (`state_of`).

The state hangs off the module `dedicate_params*` was given. A torch `DistributedDataParallel` wrapper around
that module is looked through (`unwrap`), so every public function accepts the wrapped model as well.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from . import replicate_axis as _replicate
from . import tp as _tp
from .comm import CommLedger, Streams, WaitMeter, Work, dedicated_group

if TYPE_CHECKING:
    from .group import DedicatedParamGroup
    from .param import DedicatedParam

_ATTR = "_dmuon_state"


def unwrap(model: nn.Module) -> nn.Module:
    """The module DMuon was applied to: torch DDP's `.module` for a DistributedDataParallel wrapper."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def find_state(model: nn.Module) -> DMuonState | None:
    """The model's DMuon state, or None before `dedicate_params*` (a DDP wrapper is looked through)."""
    return getattr(unwrap(model), _ATTR, None)


def state_of(model: nn.Module, what: str) -> DMuonState:
    """The model's DMuon state; `what` (the caller's name) leads the error when there is none."""
    state = find_state(model)
    if state is None:
        raise RuntimeError(
            f"{what}: the model has no dedicated params (was it called before dmuon.dedicate_params?): call "
            "dmuon.dedicate_params(model, mesh, predicate) (or dedicate_params_ddp) first, then fully_shard or "
            "DistributedDataParallel, and build dmuon.Muon last"
        )
    return state


_LIVE: weakref.WeakSet[DMuonState] = weakref.WeakSet()  # every state alive, for `release_at_exit`


def attach_state(model: nn.Module, state: DMuonState) -> None:
    """Record `state` as the model's (once: `dedicate_params*` refuses a model that has one)."""
    setattr(model, _ATTR, state)
    _LIVE.add(state)


def release_at_exit() -> int:
    """At interpreter exit (an atexit hook of the package), after a clean end: when the default process group is
    destroyed (`dist.destroy_process_group()`, as a script ends), every live DMuon state waits for its collectives
    still in flight and drops its work handles and its own process groups, so that their backends (gloo's worker
    threads) are freed now, while the interpreter is alive, and not during its teardown, where a worker releasing
    a collective's tensors must take a GIL that CPython no longer gives ("terminate called without an active
    exception"). While the default group is still up (a crash, or a script that never destroyed it) nothing is
    touched: a peer may be gone, and a wait could last the whole collective timeout. Returns how many of DMuon's
    own process groups were dropped."""
    if dist.is_available() and dist.is_initialized():
        return 0
    dropped = sum(state.release() for state in list(_LIVE))
    gc.collect()
    return dropped


atexit.register(release_at_exit)


class DPAxes:
    """The data-parallel axes a set of dedicated matrices is owned over: the shard group (owners, forward
    broadcasts, stage-1 reduces), the replicate group (HSDP: stage-2 reduces, the publish), this rank's coordinates
    on them and every rank's (shard, replicate, tp) coordinates. The dense matrices have the state's; expert stacks
    under expert parallelism have their own (`dedicate_params(..., expert_mesh=...)`), whose shard group is the
    expert-data-parallel one and whose "tp" coordinate tells the expert shards apart.

    `grad_scale` multiplies the averaged grad on the owner: an expert's grad on its expert-parallel rank already
    sums every rank's tokens routed to it, so averaging over the expert shard group (size G_e) leaves it
    G/G_e times the dense average over G ranks: scale G_e/G (1 for dense matrices)."""

    def __init__(
        self,
        shard_mesh,
        replicate_mesh,
        tp_rank: int,
        *,
        desc: str,
        grad_scale: float = 1.0,
        replicate_group: dist.ProcessGroup | None = None,
    ):
        self.shard_mesh = shard_mesh
        self.replicate_mesh = replicate_mesh
        # DMuon's own process groups, with the meshes' ranks: on NCCL the shard axis (the per-group broadcasts and
        # reduces the forward and backward wait on) gets a high-priority stream, the replicate axis a default one
        # (comm.dedicated_group says why FSDP2's mesh groups cannot give that). A missing mesh, or one of a
        # single rank, is an axis of size 1 (DDP has no shard axis, 1D FSDP no replicate axis).
        self.shard_group = dedicated_group(shard_mesh, high_priority=True, desc=f"{desc}_shard")
        self.replicate_group = replicate_group or dedicated_group(
            replicate_mesh, high_priority=False, desc=f"{desc}_replicate"
        )
        self.shard_size = dist.get_world_size(self.shard_group) if self.shard_group is not None else 1
        self.replicate_size = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
        self.shard_rank = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        self.replicate_rank = dist.get_rank(self.replicate_group) if self.replicate_group is not None else 0
        self.tp_rank = tp_rank  # this rank's TP coordinate (0 without TP): one DP slice per TP rank
        self.grad_scale = grad_scale
        # (shard, replicate, tp) coordinates of every global rank, gathered once: owner lookups need no guessing.
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.shard_rank, self.replicate_rank, self.tp_rank))
        self.coords = coords
        self.coord_to_global = {c: r for r, c in enumerate(coords)}

    def owner_global_rank(self, dp: DedicatedParam, tp_rank: int | None = None) -> int:
        """Global rank of a param's DP owner in the DP slice of TP rank `tp_rank` (default: this rank's)."""
        tp = self.tp_rank if tp_rank is None else tp_rank
        return self.coord_to_global[(dp.owner_shard, dp.owner_replicate, tp)]

    def shard_global_rank(self, shard: int) -> int:
        return dist.get_global_rank(self.shard_group, shard) if self.shard_group is not None else dist.get_rank()

    def replicate_global_rank(self, rep: int) -> int:
        return dist.get_global_rank(self.replicate_group, rep)


class DMuonState:
    """Per-model DMuon state: the DP axes, groups in forward order, the reduce pipeline, the ledger."""

    def __init__(
        self,
        *,
        shard_mesh,
        replicate_mesh,
        reshard_after_forward: bool,
        mode: str = "fsdp",
        tp_rank: int = 0,
        tp_buffer_reuse: bool | str = False,
    ):
        self.axes = DPAxes(shard_mesh, replicate_mesh, tp_rank, desc="dmuon")
        self.expert_axes: DPAxes | None = None  # expert stacks' own axes under expert parallelism (api.py)
        self.reshard_after_forward = reshard_after_forward
        self.mode = mode
        kinds = {
            False: (),
            True: ("gather", "scatter"),
            "all": ("gather", "scatter"),
            "gather": ("gather",),
            "scatter": ("scatter",),
        }[tp_buffer_reuse]
        self.tp_buffers = {"kinds": kinds, "store": {}} if kinds else None
        self.groups: list[DedicatedParamGroup] = []
        self.device = torch.device("cpu")  # the model's (meta until init_dedicated_params): where collectives run
        self.dparams: list[DedicatedParam] = []
        self.by_param: dict[nn.Parameter, DedicatedParam] = {}
        # per-head Muon: fqn -> (dim, size) head blocks recorded by dedicate_params (docs/dmuon.md, "Per-head Muon")
        self.head_blocks: dict[str, tuple[int, int]] = {}
        self.ledger = CommLedger()
        self.streams = Streams()  # the CUDA ones once the groups are on a GPU (comm.streams_for)
        self.publish_wait = WaitMeter()  # how long each forward waited for the post-step publish
        self.sync_grads = True
        # Unshard the next group in forward (the previous in backward) while this one computes. Off for a model that
        # is several pipeline stages: its groups' order is not the order they run in (microbatches of two stages
        # interleave, and which group's backward comes next depends on the schedule).
        self.prefetch = True
        # Free each group's packed buffer once its backward is done (under no_sync too). A pipeline schedule turns it
        # off for its step (`reduce_now` turns it on again and frees them): under Z2 a group is then broadcast
        # once per step, not once per microbatch.
        self.reshard_after_backward = True
        self._pending: list[tuple[DedicatedParamGroup, torch.Tensor, Work]] = []  # stage 1 in flight
        self._stage2: list[tuple[DedicatedParamGroup, torch.Tensor, Work]] = []  # stage 2 in flight
        self._accumulated = Work()  # the owners' accumulations, done on the replicate-axis stream
        self._callbacks: set[int] = set()  # the backwards (graph task ids) whose end-callback is queued
        self._backward_ended = False  # a backward ended since the last forward began (see `new_forward`)

    # The dense matrices' axes, by their old names (the library's and the tests' readers).
    shard_mesh = property(lambda self: self.axes.shard_mesh)
    replicate_mesh = property(lambda self: self.axes.replicate_mesh)
    shard_group = property(lambda self: self.axes.shard_group)
    replicate_group = property(lambda self: self.axes.replicate_group)
    shard_size = property(lambda self: self.axes.shard_size)
    replicate_size = property(lambda self: self.axes.replicate_size)
    shard_rank = property(lambda self: self.axes.shard_rank)
    replicate_rank = property(lambda self: self.axes.replicate_rank)
    tp_rank = property(lambda self: self.axes.tp_rank)
    coords = property(lambda self: self.axes.coords)
    coord_to_global = property(lambda self: self.axes.coord_to_global)

    def owner_global_rank(self, dp: DedicatedParam, tp_rank: int | None = None) -> int:
        """Global rank of a param's DP owner in the DP slice of TP rank `tp_rank` (default: this rank's)."""
        return dp.axes.owner_global_rank(dp, tp_rank)

    def next_group(self, g: DedicatedParamGroup) -> DedicatedParamGroup | None:
        return self.groups[g.index + 1] if g.index + 1 < len(self.groups) else None

    def prev_group(self, g: DedicatedParamGroup) -> DedicatedParamGroup | None:
        return self.groups[g.index - 1] if g.index > 0 else None

    # ---- reduce pipeline ------------------------------------------------------------------------------
    def enqueue_reduce(self, group: DedicatedParamGroup, gbuf: torch.Tensor, work: Work) -> None:
        self._pending.append((group, gbuf, work))
        # Keep one stage-1 reduce in flight; start stage 2 (replicate axis) of the older ones meanwhile.
        while len(self._pending) > 1:
            self._start_stage2(*self._pending.pop(0))

    def _start_stage2(self, group: DedicatedParamGroup, gbuf: torch.Tensor, work: Work) -> None:
        """Stage 2 goes on the replicate-axis stream (default priority, like the publish): that stream, not
        compute, waits for stage 1 and issues the replicate reduce, so the backward never waits for either."""
        with self.streams.use("replicate_broadcast"):
            self.streams.hold(gbuf)
            work.wait()
            self._stage2.append((group, gbuf, _replicate.reduce_replicate(group, gbuf)))
        # Keep one stage 2 in flight and finish the older ones now: each holds a whole packed grad buffer, so
        # waiting for the end of backward would keep every group's (P_M elements) alive on every rank.
        while len(self._stage2) > 1:
            self._finish_stage2(*self._stage2.pop(0))

    def _finish_stage2(self, group: DedicatedParamGroup, gbuf: torch.Tensor, work: Work) -> None:
        """The owner adds its slice into `_reduced_grad`, on the replicate-axis stream after stage 2 (the
        tensors it writes are allocated by compute first); compute waits for that stream once, at the end of
        backward (`finish_backward`). Then the TP matrices whose momentum lives on their TP owner have their
        reduced grads gathered there, issued now: the gathers run beside the rest of the backward."""
        group.prepare_reduced_grads()
        gathering = group.tp_gathers()
        for dp in gathering:  # an earlier backward's gather still reads the grad written below
            dp.drop_tp_gather()
        with self.streams.use("replicate_broadcast"):
            work.wait()
            group.finish_reduce(gbuf)
            self._accumulated = self._accumulated.merge(Work([self.streams.event()]))
        _tp.gather_reduced_grads(gathering, self.ledger, self.tp_buffers)

    def queue_final_callback(self, task: int) -> None:
        """Have the end of backward `task` (the autograd graph task that is running) call `finish_backward`.
        A reentrant checkpoint's inner backward is a task of its own, ended by its own callback."""
        if task not in self._callbacks:
            self._callbacks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish_backward(task))

    def new_forward(self) -> None:
        """A group's forward outside backward. The first one after a backward drops autocast's cast cache: an
        autocast region around several forward-backwards (accumulation) otherwise feeds the later forwards the
        first one's cached low-precision copy of each dedicated param, whose grad then reaches the param through
        that older graph node late in the backward, after the group reduced (and a step inside the region would
        compute with pre-step weights). Leaving an autocast region drops the cache the same way."""
        if self._backward_ended:
            self._backward_ended = False
            if torch.is_autocast_cache_enabled():
                torch.clear_autocast_cache()

    def finish_backward(self, task: int) -> None:
        """End of backward `task`: reduce the groups that entered it and whose post-backward did not reduce them
        (in group order, the same on every rank), drain both reduce stages, end those groups' backward."""
        self._callbacks.discard(task)
        self._reduce_and_end([g for g in self.groups if g._task == task])

    def reduce_now(self) -> None:
        """Reduce every group's grads accumulated so far (under `no_sync`), outside any backward: in group order,
        the same on every rank, both stages drained, the owners' reduced grads complete on return. What a
        pipeline schedule's end calls (`dmuon.reduce_grads`), where the weight grads of a zero-bubble schedule
        land after the backward that ran the groups' post-backward."""
        if not self.sync_grads:
            raise RuntimeError("dmuon.reduce_grads inside no_sync: leave the no_sync block first")
        for g in self.groups:
            g._reduced = False  # reduced (skipped) under no_sync in the schedule's backwards: now for real
        self.reshard_after_backward = True
        self._reduce_and_end(self.groups)

    def _reduce_and_end(self, groups: list[DedicatedParamGroup]) -> None:
        """Reduce `groups` not reduced yet (in order), drain both reduce stages (compute then has the owners'
        reduced grads), end their backward and free their buffers (Z2/Z3; not while a schedule holds them)."""
        for g in groups:
            g.reduce_grads()
        while self._pending:
            self._start_stage2(*self._pending.pop(0))
        while self._stage2:
            self._finish_stage2(*self._stage2.pop(0))
        accumulated, self._accumulated = self._accumulated, Work()
        accumulated.wait()  # compute: the owners' reduced grads are complete
        for g in groups:
            g.end_backward()
            if self.mode == "fsdp" and self.reshard_after_backward:
                g.reshard()
        self._backward_ended = True

    def release(self) -> int:
        """Wait for the collectives in flight (reduces, publishes, prefetched broadcasts), then drop their handles and
        this state's own process groups (DMuon's shard and replicate groups; the TP groups are the mesh's). The state
        is unusable afterwards: for the end of a process (`release_at_exit`). Returns how many groups it dropped."""
        works = [w for *_, w in self._pending + self._stage2] + [self._accumulated]
        works += [w for g in self.groups for w in (g._unshard_work, g._publish)]
        for work in works:
            if work is not None:
                work.wait()
        for dp in self.dparams:  # a TP gather from a backward no step consumed
            dp.drop_tp_gather()
        self._pending.clear()
        self._stage2.clear()
        self._accumulated = Work()
        for g in self.groups:
            g._unshard_work = g._publish = g._deferred = None
        dropped = 0
        for axes in (self.axes, self.expert_axes):
            if axes is None:
                continue
            dropped += (axes.shard_group is not None) + (axes.replicate_group is not None)
            axes.shard_group = axes.replicate_group = None
        return dropped

    def drain_publish(self) -> None:
        """Consume every group's post-step handoff (publish in flight, deferred TP tail), in group order."""
        for g in self.groups:
            g.wait_publish()

    def reshard_all(self) -> None:
        for g in self.groups:
            g.reshard()

    @contextlib.contextmanager
    def no_sync(self):
        """DMuon's reduces off inside the block: local grads accumulate in `param.grad`."""
        prev, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = prev
