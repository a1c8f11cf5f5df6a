"""ParallelDims' meshes on 8 real gloo ranks, against its own coordinates (which need no process group): for layouts
with and without EP and TP, every rank's coordinate on every mesh is the one `coordinates()` gives it, every
process group holds the ranks `groups()` names, `rank_of` / `expert_rank_of` invert the coordinates, building the
meshes warns nothing, and the expert meshes reuse the world mesh's groups where the rank sets are the same.
FSDP2 accepts an EP-sharded stack over the expert-DP mesh (one root, as it requires)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._dist import run_distributed
from titan_dmuon.parallel import ParallelDims

pytestmark = pytest.mark.slow  # several seconds of multi-rank runs: the full suite, not the quick tier

WORLD = 8
# (pp, replicate, shard, tp, ep): dense (FSDP, HSDP x TP, TP), EP with new groups (efsdp > 1, with and without TP
# and HSDP) and EP whose groups are the world's (efsdp = 1, with and without TP); and each kind under a pipeline
LAYOUTS = [
    (1, 1, 8, 1, 1),
    (1, 2, 2, 2, 1),
    (1, 1, 2, 4, 1),
    (1, 1, 8, 1, 2),
    (1, 2, 4, 1, 2),
    (1, 1, 4, 2, 2),
    (1, 1, 8, 1, 8),
    (1, 2, 4, 1, 4),
    (1, 2, 2, 2, 2),
    (2, 1, 2, 2, 1),
    (4, 1, 2, 1, 1),
    (2, 1, 4, 1, 2),
    (2, 2, 2, 1, 2),
    (2, 1, 2, 2, 2),
    (8, 1, 1, 1, 1),
]


def _ranks(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def _layout_job(rank: int, world: int) -> list[str]:
    problems = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(f"rank {rank} {layout}: {what}")

    for layout in LAYOUTS:
        P, R, S, T, E = layout
        dims = ParallelDims(dp_replicate=R, dp_shard=S, tp=T, world_size=world, ep=E, pp=P)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            world_mesh = dims.build_mesh("cpu")
        expect(not caught, f"build_mesh warned: {[str(w.message) for w in caught]}")
        m = dims.meshes
        c = {name: int(values[rank]) for name, values in dims.coordinates().items()}
        groups = {axis: next(g for g in dims.groups(axis) if rank in g) for axis in dims.axis_sizes()}

        expect(world_mesh.mesh_dim_names == ("replicate", "shard", "tp"), f"world dims {world_mesh.mesh_dim_names}")
        expect(tuple(world_mesh.get_coordinate()) == (c["replicate"], c["shard"], c["tp"]), "world coordinate")
        for axis in ("replicate", "shard", "tp"):
            mesh = getattr(m, axis)
            expect(mesh.get_local_rank() == c[axis], f"{axis} local rank")
            expect(_ranks(mesh) == groups[axis], f"{axis} group {_ranks(mesh)} != {groups[axis]}")
        expect(m.fsdp.mesh_dim_names == (("replicate", "shard") if R > 1 else ("shard",)), "fsdp dims")
        expect(m.pp.get_local_rank() == c["pp"] and _ranks(m.pp) == groups["pp"], f"pp group {_ranks(m.pp)}")
        expect(
            sorted(world_mesh.mesh.flatten().tolist()) == [g for g in range(world) if g // (world // P) == c["pp"]],
            "the world mesh is this stage's ranks",
        )
        expect(dims.rank_of(c["replicate"], c["shard"], c["tp"], c["pp"]) == rank, "rank_of")
        expect(dims.dp_coordinates(world_mesh) == (c["replicate"] * S + c["shard"], R * S), "dp_coordinates")
        expect(c["shard"] == c["efsdp"] * E + c["ep"], "shard = efsdp x ep")
        expect(c["expert_shard"] == c["efsdp"] * T + c["tp"], "expert_shard = efsdp x tp")

        if E == 1:
            expect(m.ep is None and m.experts is None and m.expert_fsdp is None, "expert meshes without EP")
            continue
        expect(
            tuple(m.experts.get_coordinate()) == (c["pp"], c["replicate"], c["expert_shard"], c["ep"]),
            "expert coordinate",
        )
        expect(m.ep.get_local_rank() == c["ep"] and _ranks(m.ep) == groups["ep"], "ep mesh")
        expect(m.expert_dp.get_local_rank() == c["expert_shard"], "expert_dp local rank")
        # the groups' members, read off the world mesh's own coordinates: an ep group varies ep only, an expert-DP
        # group keeps (replicate, ep) and varies the rest
        everyone = [None] * world
        dist.all_gather_object(everyone, (c["pp"], *world_mesh.get_coordinate()))
        efsdp_ep_tp = [(p, r, s // E, s % E, t) for p, r, s, t in everyone]
        mine = efsdp_ep_tp[rank]
        expect(
            [g for g in range(world) if efsdp_ep_tp[g][:3] + efsdp_ep_tp[g][4:] == mine[:3] + mine[4:]] == _ranks(m.ep),
            "ep group = same (pp, replicate, efsdp, tp)",
        )
        expect(
            [g for g in range(world) if (efsdp_ep_tp[g][:2], efsdp_ep_tp[g][3]) == (mine[:2], mine[3])]
            == _ranks(m.expert_dp),
            "expert_dp group = same (pp, replicate, ep)",
        )
        expect(_ranks(m.expert_dp) == groups["expert_shard"], f"expert_dp group {_ranks(m.expert_dp)}")
        expect(m.expert_dp.size() == dims.expert_shard_size, "expert_dp size")
        expect(dims.expert_rank_of(c["replicate"], c["expert_shard"], c["ep"], c["pp"]) == rank, "expert_rank_of")
        expect(m.expert_fsdp.ndim == (2 if R > 1 else 1), "expert_fsdp dims")
        expect(m.experts.get_group("replicate") is m.replicate.get_group(), "replicate group reused")
        if dims.efsdp == 1:  # the same rank sets: the world's groups, not new ones
            expect(m.ep.get_group() is m.shard.get_group(), "ep group = shard group")
            expect(m.expert_dp.get_group() is m.tp.get_group(), "expert_dp group = tp group")
    return problems


def test_meshes_match_the_coordinates() -> None:
    problems = [p for per_rank in run_distributed(_layout_job, WORLD) for p in per_rank]
    assert not problems, "\n".join(problems[:20])


class _Stack(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self) -> torch.Tensor:
        return self.w.to_local().sum()  # this EP rank's experts


def _fsdp_expert_job(rank: int, world: int) -> list[float]:
    """An EP-sharded stack (DTensor Shard(0) over the ep mesh) under fully_shard over the expert-FSDP mesh, HSDP
    (replicate 2 x efsdp 2 x ep 2): FSDP2 joins the two meshes (they must share one root), gathers, and the
    reduced grad is every rank's sum."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dims = ParallelDims(dp_replicate=2, dp_shard=4, tp=1, world_size=world, ep=2)
    dims.build_mesh("cpu")
    m = dims.meshes
    experts = _Stack(distribute_tensor(torch.ones(4, 2, 3), m.ep, [Shard(0)]))
    fully_shard(experts, mesh=m.expert_fsdp)
    experts.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    experts.set_gradient_divide_factor(1.0)
    experts().backward()
    grad = experts.w.grad.full_tensor()
    return [float(grad.sum()), float(grad.numel())]


def test_fsdp2_shards_an_ep_stack_over_the_expert_mesh() -> None:
    for total, numel in run_distributed(_fsdp_expert_job, WORLD):
        # each rank's local (2 experts) share gets grad 1 from each of the 4 expert-DP ranks (replicate x efsdp)
        assert numel == 4 * 2 * 3 and total == 4 * numel
