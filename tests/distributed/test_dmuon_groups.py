"""DMuon's own process groups (titan_dmuon.dmuon.comm.dedicated_group), on real gloo ranks: a new group per mesh
axis with the mesh group's ranks in the same order, its backend and timeout, not the group FSDP2 uses, made by
its members alone (the sibling groups of a 2D mesh at once), working for DMuon's collectives; None for an axis
of one rank; a clear error, not a hang, where the members would name the group differently. The NCCL options
(a high-priority stream on the shard axis) are checked without NCCL, on a stand-in options class.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests._dist import backend_name, run_distributed
from titan_dmuon.dmuon.comm import (
    _group_timeout,
    _nccl_options,
    _split_from_parent,
    broadcast_coalesced,
    dedicated_group,
    reduce_coalesced,
)

pytestmark = pytest.mark.skipif(backend_name() != "gloo", reason="checks the gloo path; NCCL is a GPU check")

WORLD = 4
AXES = (("shard", True), ("replicate", False))  # (mesh dim, high priority): the design's stream priorities
PARENT_TIMEOUT = timedelta(seconds=321)


def _two_d_groups(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {"split_from_parent": _split_from_parent(True)}  # gloo world, no bound device: new_group's path
    for axis, high in AXES:
        sub = mesh[axis]
        parent = sub.get_group()
        dist.distributed_c10d._set_pg_timeout(PARENT_TIMEOUT, parent)  # the new group inherits it
        group = dedicated_group(sub, high_priority=high, desc=f"dmuon_{axis}")
        again = dedicated_group(sub, high_priority=high)  # the same ranks once more: another group, another name
        # DMuon's own collectives on it: an async all-reduce, a coalesced broadcast and an averaging reduce
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, group=group, async_op=True).wait()
        root = dist.get_global_rank(group, 1)
        bcast = torch.full((3,), float(rank))
        broadcast_coalesced([(bcast, root)], group, None, "broadcast").wait()
        avg = torch.tensor([float(rank)])
        reduce_coalesced([(avg, root)], again, None, "reduce").wait()
        # interleaved with a collective on the mesh's group (FSDP2's) while DMuon's is in flight
        work = dist.broadcast(torch.zeros(2), src=dist.get_global_rank(group, 0), group=group, async_op=True)
        on_parent = torch.tensor([1.0])
        dist.all_reduce(on_parent, group=parent)
        work.wait()
        out[axis] = dict(
            ranks=dist.get_process_group_ranks(group),
            again_ranks=dist.get_process_group_ranks(again),
            parent_ranks=dist.get_process_group_ranks(parent),
            new_objects=group is not parent and again is not parent and again is not group,
            names=(group.group_name, again.group_name, parent.group_name),
            rank=dist.get_rank(group),
            parent_rank=dist.get_rank(parent),
            backend=(str(dist.get_backend(group)), str(dist.get_backend(parent))),
            desc=group.group_desc,
            timeout=_group_timeout(group),
            total=total.item(),
            root=root,
            bcast=bcast.tolist(),
            avg=avg.item() if rank == root else None,
            on_parent=on_parent.item(),
        )
    one = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    out["one_rank"] = dedicated_group(one["shard"], high_priority=True)
    out["none"] = dedicated_group(None, high_priority=True)
    return out


def test_dedicated_groups_of_a_2d_mesh():
    results = run_distributed(_two_d_groups, WORLD, timeout=180)
    for rank, out in enumerate(results):
        assert out["split_from_parent"] is False
        assert out["one_rank"] is None and out["none"] is None
        for axis, _ in AXES:
            r = out[axis]
            assert r["ranks"] == r["parent_ranks"] == r["again_ranks"], (rank, axis, r)
            assert rank in r["ranks"] and len(r["ranks"]) == 2
            assert r["new_objects"] and len(set(r["names"])) == 3, (rank, axis, r["names"])
            assert r["rank"] == r["parent_rank"]
            assert r["backend"] == ("gloo", "gloo")
            assert r["desc"] == f"dmuon_{axis}"
            assert r["timeout"] == PARENT_TIMEOUT
            assert r["total"] == sum(g + 1 for g in r["ranks"])
            assert r["root"] == r["ranks"][1]
            assert r["bcast"] == [float(r["root"])] * 3
            if rank == r["root"]:
                assert r["avg"] == pytest.approx(sum(r["ranks"]) / 2)
            assert r["on_parent"] == 2.0
    # the same group on both of its members: the ranks and names agree (the rendezvous found each other)
    for axis, _ in AXES:
        by_ranks: dict[tuple, set] = {}
        for out in results:
            by_ranks.setdefault(tuple(out[axis]["ranks"]), set()).add(out[axis]["names"][:2])
        assert all(len(names) == 1 for names in by_ranks.values()), by_ranks
        assert sorted(by_ranks) == ([(0, 1), (2, 3)] if axis == "shard" else [(0, 2), (1, 3)])


def _mismatched_names(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)  # a group rank 0 alone holds
    try:
        group = dedicated_group(mesh["shard"], high_priority=True)
    except RuntimeError as e:
        return str(e)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return f"ok {t.item()}"


def test_members_that_would_name_the_group_differently_raise():
    results = run_distributed(_mismatched_names, WORLD, timeout=120)
    assert results[2] == results[3] == "ok 2.0"  # the other shard group is unaffected
    for msg in results[:2]:
        assert "hold different numbers of process groups" in msg, msg


class _StandInOptions:
    """What the test needs of `dist.ProcessGroupNCCL.Options` (absent from a CPU-only torch)."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout = timedelta(minutes=10)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
@pytest.mark.parametrize("high_priority", [True, False])
def test_nccl_options(backend, high_priority):
    timeout = timedelta(seconds=42)
    opts = _nccl_options(backend, high_priority=high_priority, timeout=timeout, options_cls=_StandInOptions)
    assert isinstance(opts, _StandInOptions)
    assert opts.is_high_priority_stream is high_priority
    assert opts._timeout == timeout
    kept = _nccl_options(backend, high_priority=True, timeout=None, options_cls=_StandInOptions)
    assert kept._timeout == timedelta(minutes=10)  # no timeout to inherit: the options' own default stays


@pytest.mark.parametrize("backend", ["gloo", "fake", "cpu:gloo"])
def test_no_options_without_nccl(backend):
    assert _nccl_options(backend, high_priority=True, options_cls=_StandInOptions) is None


@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch built with NCCL")
def test_real_nccl_options():
    opts = _nccl_options("nccl", high_priority=True, timeout=timedelta(seconds=42))
    assert isinstance(opts, dist.ProcessGroupNCCL.Options)
    assert opts.is_high_priority_stream is True and opts._timeout == timedelta(seconds=42)
