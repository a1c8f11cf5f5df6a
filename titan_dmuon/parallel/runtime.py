"""The process group, with timeouts that end a job whose rank died or hung instead of letting it wait.

torch's defaults wait 30 min (gloo) or 10 min (NCCL) in a collective a peer never joins, and the groups that
init_device_mesh makes do not inherit init_process_group's timeout. So every group gets `comm.init_timeout_seconds`
until the first step is done (rendezvous, mesh, weight init, the first step and its compile) and
`comm.train_timeout_seconds` after it. On a timeout gloo raises in the waiting rank (train.py reports it and exits
1; torchrun then stops that node's other ranks, srun --kill-on-bad-exit=1 the other nodes); NCCL's watchdog
aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, set here where unset).

`DistributedRuntime` is what the trainer holds of all this: the group (made or adopted), the timeout switch, the
heartbeat, the one-line report of a failed collective (failures.py) and the teardown.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_dmuon.config import Comm

from .failures import comm_failures, describe_comm_failure
from .heartbeat import Heartbeat
from .layout import RankPlace, gather_places, node_names, this_place

_OWN_TIMEOUT: weakref.WeakSet = weakref.WeakSet()
"""Groups made by new_group_with_timeout: set_collective_timeout leaves their timeout alone."""


def init_process_group(device: torch.device, comm: Comm) -> None:
    """gloo on CPU, NCCL on CUDA, every collective bounded by comm.init_timeout_seconds. Under torchrun (also
    under srun) it joins the rendezvous; a lone `python train.py` makes a group of one, no rendezvous needed."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a timed-out NCCL collective ends the process
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def set_collective_timeout(seconds: float) -> None:
    """Bound every collective of every process group this process has made so far (the default group and the
    mesh's) by `seconds`, except those made by new_group_with_timeout; groups made later get torch's default."""
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        if group not in _OWN_TIMEOUT:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def new_group_with_timeout(seconds: float) -> dist.ProcessGroup:
    """A gloo group over every rank bounded by `seconds`, which set_collective_timeout does not lower: e.g. the
    async checkpoint thread's, whose save may take much longer than a training collective may wait."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    _OWN_TIMEOUT.add(group)
    return group


def _timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The group's current collective timeout (None where the backend does not say)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        if device in group._device_types:
            options = getattr(group._get_backend(device), "options", None)
            if options is not None and hasattr(options, "_timeout"):
                return options._timeout
    return None


@contextmanager
def raised_collective_timeout(seconds: float) -> Iterator[None]:
    """Bound the default group's collectives by at least `seconds` inside the block, then restore its timeout:
    for phases (a checkpoint save or load) in which a rank may wait that long for a slower peer."""
    group = dist.distributed_c10d._get_default_group()
    before = _timeout(group)
    if before is None or before >= timedelta(seconds=seconds):
        yield
        return
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(before, group)


def destroy_process_groups() -> int:
    """Destroy every process group (`dist.destroy_process_group()`) and free them now: returns how many
    references to a destroyed group were dropped.

    destroy_process_group only unregisters the groups; their C++ backends live on while a Python object still
    holds them (torch's DeviceMesh `_pg_registry`, FSDP2's `FSDPMeshInfo.shard_process_group`, DMuon's state),
    and those live until the interpreter's teardown, with gloo's worker threads. A worker that drops the last
    reference to a finished collective (e.g. `all_gather_object`'s tensors) during that teardown must take the
    GIL, and CPython then ends the thread inside a C++ destructor: "terminate called without an active
    exception", SIGABRT after a clean run. Dropping the references here frees each backend while the
    interpreter is alive, which joins its threads. Only after a clean end: a group stuck in a collective
    with a dead peer would hold its join until the timeout."""
    dist.destroy_process_group()
    dropped = 0
    kinds: dict[type, int] = {}
    with warnings.catch_warnings():  # the scan touches deprecated torch objects (`dist.reduce_op`): no noise
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                dropped += _drop_group_refs(obj, kinds)
            except Exception:  # an object whose attributes cannot be read: a dead weakref.proxy
                continue  # (torch.compile keeps some), a pydantic mock validator (wandb) raising on __dict__
    gc.collect()
    return dropped


def _drop_group_refs(obj: object, kinds: dict[type, int]) -> int:
    """Drop the process groups `obj` holds in its attributes (or in a dict attribute); how many.

    `kinds` caches per type whether it is a group (1), a dict (2) or neither (0): `isinstance(v,
    dist.ProcessGroup)` goes through torch's opaque-type metaclass in Python, and the scan asks it of every
    attribute of every object (a second per rank, most of a small multi-rank job's teardown; the cached type
    test takes a tenth of that)."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return 0
    dropped = 0
    for name, value in list(attrs.items()):
        kind = _kind(type(value), kinds)
        if kind == _GROUP:
            attrs[name] = None
            dropped += 1
        elif kind == _DICT:
            for key in [k for k, v in list(value.items()) if _kind(type(v), kinds) == _GROUP]:
                del value[key]
                dropped += 1
    return dropped


_GROUP, _DICT = 1, 2


def _kind(cls: type, kinds: dict[type, int]) -> int:
    kind = kinds.get(cls)
    if kind is None:
        kind = kinds[cls] = _GROUP if issubclass(cls, dist.ProcessGroup) else _DICT if issubclass(cls, dict) else 0
    return kind


def ranks_per_node() -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


class DistributedRuntime:
    """This process's side of the job: the process group (made here, or adopted from a caller such as a test
    harness, and then left alone), its collective timeout (comm.init_timeout_seconds until the first step is done,
    comm.train_timeout_seconds after), the heartbeat, the report of a failed collective, and the teardown.

    Only a group this runtime made gets the timeouts and the heartbeat: an adopted group is its owner's."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.owns_process_group = False
        self.collective_timeout = float(comm.init_timeout_seconds)  # what a timed-out collective waited
        self._train_timeout_set = False
        self.heartbeat: Heartbeat | None = None
        self.place = this_place()
        self.hosts: list[str] = []  # a node name per rank, once `meet` has run

    def init(self, device: torch.device) -> None:
        """Join (or make) the process group; one that already exists is used as it is."""
        if dist.is_initialized():
            return
        init_process_group(device, self.comm)  # torchrun (also under srun), or a group of one
        self.owns_process_group = True

    def meet(self) -> list[RankPlace]:
        """Every rank's place (one all_gather_object). On a group this runtime made, the mesh's groups (made with
        torch's default) are first bound by the init timeout too and the heartbeat starts before that collective,
        so that after it every rank's key exists and the watchers can watch."""
        if self.owns_process_group:
            set_collective_timeout(self.collective_timeout)
            world = dist.get_world_size()
            if world > 1 and self.comm.heartbeat_seconds > 0:
                store = dist.distributed_c10d._get_default_store()
                self.heartbeat = Heartbeat(store, dist.get_rank(), world, self.comm.heartbeat_seconds)
                self.heartbeat.start()
        places = gather_places()
        self.hosts = node_names(places)
        if self.heartbeat is not None:
            self.heartbeat.watch(self.hosts)
        return places

    def use_train_timeout(self) -> None:
        """Set-up and the first step (its compile) are done: from now on a collective waits
        comm.train_timeout_seconds. Only once, and only on a group this runtime made."""
        if self.owns_process_group and not self._train_timeout_set:
            self._train_timeout_set = True
            self.collective_timeout = float(self.comm.train_timeout_seconds)
            set_collective_timeout(self.collective_timeout)

    def describe_failure(self, exc: BaseException) -> str | None:
        """The one-line report of `exc` if a peer died or hung (failures.py), naming the ranks the heartbeat
        found silent; None for any other error."""
        silent = self.heartbeat.silent_ranks() if self.heartbeat is not None else []
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        return describe_comm_failure(exc, rank, self.place.host, self.collective_timeout, silent)

    def comm_failures(self) -> contextlib.AbstractContextManager:
        """A block in which a failed collective becomes CommFailureError(describe_failure(exc))."""
        return comm_failures(self.describe_failure)

    def stop_heartbeat(self, graceful: bool) -> None:
        """Stop beating; graceful (a normal end) also tells the watchers not to report this rank."""
        if self.heartbeat is not None:
            self.heartbeat.stop(clean=graceful)
            self.heartbeat = None

    def close(self, graceful: bool = True) -> None:
        """Stop the heartbeat and destroy the group this runtime made. graceful frees every group now, joining
        gloo's threads (destroy_process_groups); otherwise (after an unexpected error, peers maybe gone or stuck)
        only unregister them, talking to no other rank."""
        self.stop_heartbeat(graceful)
        if self.owns_process_group and dist.is_initialized():
            if graceful:
                destroy_process_groups()
            else:
                dist.destroy_process_group()
        self.owns_process_group = False
