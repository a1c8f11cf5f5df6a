"""Parallel degrees of a run, where every rank sits, and the DeviceMeshes every parallelism uses.

The ranks are laid out row-major over ("pp", "replicate", "shard", "tp"), outermost first, even when a degree is 1:
TP ranks are adjacent (one node), then shard ranks, then replicas, then pipeline stages. The root mesh always has
exactly these four named dims, so no code path depends on which degrees happen to be > 1 (a size-1 dim costs one
trivial process group). Each pipeline stage's ranks form one (replicate, shard, tp) mesh, `meshes.world`: every
dense parallelism (TP, DMuon, FSDP2, EP) lives inside it, and only the pipeline's point-to-point sends cross it
(`meshes.pp`, the ranks with the same (replicate, shard, tp) coordinates in every stage).

Expert parallelism (ep > 1) splits the shard coordinate into efsdp (outer, the shard ranks that hold the same
experts) x ep (inner, the ranks the experts are split over), so the dense params see the same shard axis as
without EP, and the EP groups are ep consecutive shard ranks:

    rank = pp_index * stage_size + ((replicate * efsdp + efsdp_index) * ep + ep_index) * tp + tp_index,
    shard = efsdp_index * ep + ep_index,    stage_size = replicate * shard * tp

The expert stacks use a second mesh over the same ranks, ("pp", "replicate", "expert_shard", "ep"), expert_shard =
efsdp_index * tp + tp_index: the ranks that hold the same experts and route different tokens through them (under
TP each rank routes its own sequence chunk). Its process groups are the world mesh's where the rank sets are the
same (replicate always; ep = shard when efsdp = 1; expert_shard = tp when efsdp = 1); only the others are new.

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")    -> this stage's (replicate, shard, tp) mesh ("world": the whole world without a
                                        pipeline); dims.meshes keeps it and every other mesh of the run
    dims.meshes.pp                   -> the pipeline's point-to-point group (PipelineStage)
    dims.meshes.tp                   -> apply_tp
    dims.meshes.shard, .replicate    -> dmuon.dedicate_params(..., shard, replicate_mesh=replicate) (HSDP)
    dims.meshes.fsdp                 -> fully_shard: (replicate, shard) under HSDP, else shard
    dims.meshes.ep                   -> apply_ep: the experts split over ep ranks, tokens by all-to-all
    dims.meshes.expert_dp            -> DMuon's expert_mesh (1D expert_shard)
    dims.meshes.expert_fsdp          -> fully_shard of the expert stacks: (replicate, expert_shard) or expert_shard
    dims.dp_coordinates()            -> (dp_rank, dp_world_size) for the data loader (TP ranks share data)

Every mesh is built once, by build_mesh, with torch's public API (init_device_mesh, slicing root dims,
new_subgroups_by_enumeration, DeviceMesh.from_group); consumers take them from the record by name. The coordinate
methods (`coordinates`, `rank_of`, `expert_rank_of`, `groups`) say the same layout without any process group, so
a planner places any world on one CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_dmuon.config import JobConfig, validate_parallelism
from titan_dmuon.config.manager import parallel_degrees_problem

MESH_DIM_NAMES = ("replicate", "shard", "tp")
"""The dims of a stage's mesh (`meshes.world`)."""
ROOT_MESH_DIM_NAMES = ("pp", *MESH_DIM_NAMES)
EXPERT_MESH_DIM_NAMES = ("replicate", "expert_shard", "ep")
# The axes `coordinates` and `groups` name, each with the axes of its mesh: a group varies one axis and fixes the
# others of its mesh. "efsdp" and "ep" split "shard" (the same ranks as the world mesh, shard = efsdp x ep). Every
# mesh is per pipeline stage ("pp" fixed), but for the pp axis itself.
_AXES_OF_MESH = (ROOT_MESH_DIM_NAMES, ("pp", *EXPERT_MESH_DIM_NAMES), ("pp", "replicate", "efsdp", "ep", "tp"))


@dataclass(frozen=True)
class Meshes:
    """Every DeviceMesh of a run, built once by `ParallelDims.build_mesh`. The dense ones are slices of `world`;
    under expert parallelism the expert ones are slices of `experts` (None without EP)."""

    world: DeviceMesh
    """(replicate, shard, tp): this pipeline stage's ranks (the whole world without a pipeline)."""
    replicate: DeviceMesh
    shard: DeviceMesh
    tp: DeviceMesh
    fsdp: DeviceMesh
    """FSDP2's mesh: (replicate, shard) under HSDP, else `shard`."""
    root: DeviceMesh | None = None
    """(pp, replicate, shard, tp): the root every dense slice is cut from (DMuon reads a rank's slice coordinate, its
    non-DP coordinates, off it)."""
    pp: DeviceMesh | None = None
    """The 1D pipeline mesh: the ranks at this rank's (replicate, shard, tp) coordinates in every stage."""
    experts: DeviceMesh | None = None
    """(pp, replicate, expert_shard, ep) over the same ranks: the root of the expert slices, so FSDP2 can join the
    expert stacks' EP placement with their expert-DP mesh (it requires one root)."""
    ep: DeviceMesh | None = None
    expert_dp: DeviceMesh | None = None
    """The 1D expert_shard mesh: the ranks that hold the same experts (DMuon's `expert_mesh`)."""
    expert_fsdp: DeviceMesh | None = None
    """FSDP2's mesh for the expert stacks: (replicate, expert_shard) under HSDP, else `expert_dp`."""

    @property
    def device_type(self) -> str:
        return self.world.device_type


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh axes; pp x replicate x shard x tp is the world size, ep divides shard. Its fields are the
    degrees only (immutable, compared, printed); `build_mesh` adds the record of meshes as a plain attribute, so
    `dataclasses.asdict` and `dataclasses.replace` never carry process groups."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallelism, borrowed from dp_shard
    pp: int = 1  # pipeline stages' rank groups (the outermost axis)

    def __post_init__(self) -> None:
        problem = parallel_degrees_problem(self.dp_replicate, self.dp_shard, self.tp, self.world_size, self.ep, self.pp)
        if problem is not None:
            raise ValueError(f"{self!r}: {problem}")

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int, ranks_per_node: int | None = None) -> ParallelDims:
        """Resolve the configured degrees (shard = -1 takes the remaining ranks, replicate = "nodes" one replica per
        node of ranks_per_node ranks); raises ConfigError."""
        replicate, shard, tp = validate_parallelism(cfg, world_size, ranks_per_node)
        ep, pp = cfg.parallelism.expert_parallel_degree, cfg.parallelism.pipeline_parallel_degree
        return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size, ep=ep, pp=pp)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (replicate x shard): each sees different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage (replicate x shard x tp): the world size without a pipeline."""
        return self.world_size // self.pp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def non_dp_size(self) -> int:
        """Ranks that process the same tokens (TP, and every stage of a pipeline): divides per-rank token counts for
        per-device throughput."""
        return self.tp * self.pp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Shard ranks that hold the same experts (dp_shard / ep)."""
        return self.dp_shard // self.ep

    @property
    def expert_shard_size(self) -> int:
        """Ranks that hold the same experts and route different tokens through them: efsdp x tp (DMuon's
        `expert_mesh`, FSDP2's shard group of the expert stacks)."""
        return self.efsdp * self.tp

    # ---------------------------------------------------------------------------------- coordinates (no process group)

    def axis_sizes(self) -> dict[str, int]:
        """The size of every named axis (those of `coordinates`)."""
        return {
            "pp": self.pp,
            "replicate": self.dp_replicate,
            "shard": self.dp_shard,
            "tp": self.tp,
            "efsdp": self.efsdp,
            "ep": self.ep,
            "expert_shard": self.expert_shard_size,
        }

    def coordinates(self) -> dict[str, np.ndarray]:
        """Every global rank's coordinate on each named axis ("pp", "replicate", "shard", "tp", and the expert axes
        "efsdp", "ep", "expert_shard", which exist at ep = 1 too, with ep = 0 everywhere): axis name -> int64 array
        indexed by global rank, as the DeviceMeshes of `build_mesh` number them (the module docstring's formula)."""
        world = np.arange(self.world_size, dtype=np.int64)
        g = world % self.stage_size  # the rank within its stage
        tp = g % self.tp
        shard = (g // self.tp) % self.dp_shard
        efsdp, ep = shard // self.ep, shard % self.ep
        return {
            "pp": world // self.stage_size,
            "replicate": g // (self.tp * self.dp_shard),
            "shard": shard,
            "tp": tp,
            "efsdp": efsdp,
            "ep": ep,
            "expert_shard": efsdp * self.tp + tp,
        }

    def rank_of(self, replicate: int, shard: int, tp: int, pp: int = 0) -> int:
        """The global rank at a (replicate, shard, tp) coordinate of pipeline stage group `pp`."""
        return pp * self.stage_size + (replicate * self.dp_shard + shard) * self.tp + tp

    def expert_rank_of(self, replicate: int, expert_shard: int, ep: int, pp: int = 0) -> int:
        """The global rank at a coordinate of the expert axes (replicate, expert_shard, ep) of stage group `pp`."""
        efsdp, tp = divmod(expert_shard, self.tp)
        return self.rank_of(replicate, efsdp * self.ep + ep, tp, pp)

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis` (a name of `coordinates`): the ranks that share every other
        coordinate of the axis's mesh, each group in the order of its coordinate on `axis` (= its group rank),
        the groups in order of their first rank."""
        axes = next((a for a in _AXES_OF_MESH if axis in a), None)
        if axes is None:
            raise ValueError(f"unknown mesh axis {axis!r}: one of {sorted(self.axis_sizes())}")
        coords = self.coordinates()
        members: dict[tuple[int, ...], list[int]] = {}
        for g in range(self.world_size):
            members.setdefault(tuple(int(coords[a][g]) for a in axes if a != axis), []).append(g)
        return sorted(sorted(m, key=lambda g: int(coords[axis][g])) for m in members.values())

    # ------------------------------------------------------------------------------------------------ the meshes

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build every mesh of the run over the default process group (a collective: every rank calls it), keep
        them in `meshes`, and return this stage's mesh (replicate, shard, tp). The only place meshes are built."""
        root = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=ROOT_MESH_DIM_NAMES
        )
        world = root[MESH_DIM_NAMES]
        replicate, shard, tp = root["replicate"], root["shard"], root["tp"]
        meshes = Meshes(
            world=world,
            replicate=replicate,
            shard=shard,
            tp=tp,
            fsdp=root["replicate", "shard"] if self.hsdp else shard,
            root=root,
            pp=root["pp"],
        )
        if self.ep_enabled:
            experts = self._build_expert_mesh(root)
            expert_dp = experts["expert_shard"]
            meshes = dataclasses.replace(
                meshes,
                experts=experts,
                ep=experts["ep"],
                expert_dp=expert_dp,
                expert_fsdp=experts["replicate", "expert_shard"] if self.hsdp else expert_dp,
            )
        object.__setattr__(self, "_meshes", meshes)  # the dataclass is frozen: the record is set here only
        return world

    def _build_expert_mesh(self, root: DeviceMesh) -> DeviceMesh:
        """The (pp, replicate, expert_shard, ep) mesh from one process group per dim: the root's where the rank sets
        are the same, new ones (every rank takes part in creating each) otherwise. The pp dim (size 1 without a
        pipeline) keeps the expert slices of two stages apart, as the root mesh does the dense ones."""
        reuse = self.efsdp == 1  # the shard axis is all ep, and the ranks holding the same experts are a TP group
        ep_group = root.get_group("shard") if reuse else self._new_group("ep")
        expert_shard_group = root.get_group("tp") if reuse else self._new_group("expert_shard")
        layout = torch.tensor(
            [
                [
                    [[self.expert_rank_of(r, s, e, p) for e in range(self.ep)] for s in range(self.expert_shard_size)]
                    for r in range(self.dp_replicate)
                ]
                for p in range(self.pp)
            ]
        )
        return DeviceMesh.from_group(
            [root.get_group("pp"), root.get_group("replicate"), expert_shard_group, ep_group],
            root.device_type,
            mesh=layout,
            mesh_dim_names=("pp", *EXPERT_MESH_DIM_NAMES),
        )

    def _new_group(self, axis: str) -> dist.ProcessGroup:
        """This rank's group along `axis`, creating every group of that axis (in one order on every rank)."""
        group, _ = dist.new_subgroups_by_enumeration(self.groups(axis), group_desc=f"mesh_{axis}")
        return group

    @property
    def meshes(self) -> Meshes:
        """Every mesh of the run (built by `build_mesh`)."""
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) builds the meshes: call it first (every rank)")
        return meshes

    def _record(self, mesh: DeviceMesh | None) -> Meshes:
        """The record, checking that a `mesh` a caller passes along is the world mesh it holds."""
        meshes = self.meshes
        if mesh is not None and mesh is not meshes.world:
            raise ValueError("this mesh is not the one ParallelDims.build_mesh returned: pass that one, or none")
        return meshes

    # The accessors below take the world mesh for callers that pass it along (optional, checked).

    def shard_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        """The 1D shard mesh (DMuon's shard axis; under EP efsdp x ep, the same ranks)."""
        return self._record(mesh).shard

    def fsdp_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        """FSDP2's mesh: 2D (replicate, shard) for HSDP, else the 1D shard mesh."""
        return self._record(mesh).fsdp

    def expert_dp_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        """The 1D mesh of the ranks that hold the same experts and route different tokens through them
        (expert_shard: efsdp, x tp under TP). Expert parallelism only."""
        return _expert(self._record(mesh).expert_dp)

    def expert_fsdp_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        """FSDP2's mesh for the experts: the expert-DP mesh, 2D with replicate under HSDP. Expert parallelism only."""
        return _expert(self._record(mesh).expert_fsdp)

    def dp_coordinates(self, mesh: DeviceMesh | None = None) -> tuple[int, int]:
        """(dp_rank, dp_world_size) of this process: the TP ranks of one DP group get the same data."""
        meshes = self._record(mesh)
        dp_rank = meshes.replicate.get_local_rank() * self.dp_shard + meshes.shard.get_local_rank()
        return dp_rank, self.dp_world_size

    def describe(self) -> str:
        ep = f" (ep {self.ep} x efsdp {self.efsdp})" if self.ep_enabled else ""
        pp = f"pp {self.pp} x " if self.pp_enabled else ""
        return f"world {self.world_size} = {pp}replicate {self.dp_replicate} x shard {self.dp_shard}{ep} x tp {self.tp}"


def _expert(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        raise RuntimeError("no expert meshes: they exist under expert parallelism only (expert_parallel_degree > 1)")
    return mesh
