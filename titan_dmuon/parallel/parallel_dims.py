"""Parallel degrees of a run and the one DeviceMesh every parallelism slices.

The mesh always has the three named dims ("replicate", "shard", "tp"), outermost first, even when a degree
is 1: every consumer slices by name (DMuon needs exactly "shard" and "replicate"), so no code path depends on
which degrees happen to be > 1, and a size-1 dim costs one trivial process group.

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    mesh["tp"]                   -> apply_tp
    dims.shard_mesh(mesh)        -> dmuon.dedicate_params(..., dims.shard_mesh(mesh), replicate_mesh=mesh["replicate"])
    dims.fsdp_mesh(mesh)         -> fully_shard: mesh["replicate", "shard"] (HSDP) or mesh["shard"]
    dims.dp_coordinates(mesh)    -> (dp_rank, dp_world_size) for the data loader (TP ranks share data)

Expert parallelism (ep > 1) splits the shard axis: the mesh is then built as (replicate, efsdp, ep, tp) with
"shard" the flattened (efsdp, ep), so the dense params see the same shard axis as without EP:

    mesh["ep"]                   -> apply_ep: the experts split over ep ranks, tokens by all-to-all
    dims.expert_dp_mesh(mesh)    -> the ranks that hold the same experts and see different tokens: efsdp (x tp,
                                    flattened to "expert_shard"); DMuon's expert_mesh, FSDP2's for the experts
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_dmuon.config import JobConfig, validate_parallelism

MESH_DIM_NAMES = ("replicate", "shard", "tp")
EP_MESH_DIM_NAMES = ("replicate", "efsdp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the three mesh axes; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallelism, borrowed from dp_shard

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ValueError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x tp ({self.tp}) "
                f"!= world_size ({self.world_size})"
            )
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(f"ParallelDims.ep ({self.ep}) must be >= 1 and divide dp_shard ({self.dp_shard})")

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int, ranks_per_node: int | None = None) -> ParallelDims:
        """Resolve the configured degrees (shard = -1 takes the remaining ranks, replicate = "nodes" one replica per
        node of ranks_per_node ranks); raises ConfigError."""
        replicate, shard, tp = validate_parallelism(cfg, world_size, ranks_per_node)
        ep = cfg.parallelism.expert_parallel_degree
        return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size, ep=ep)

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (replicate x shard): each sees different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def non_dp_size(self) -> int:
        """Ranks that process the same tokens (TP): divides per-rank token counts for per-device throughput."""
        return self.tp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Shard ranks that hold the same experts (dp_shard / ep)."""
        return self.dp_shard // self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The run's DeviceMesh (replicate, shard, tp) over the default process group; the only place a mesh is
        built. Ranks are laid out row-major, so TP ranks are adjacent (same node), then EP ranks."""
        if not self.ep_enabled:
            shape = (self.dp_replicate, self.dp_shard, self.tp)
            return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        shape = (self.dp_replicate, self.efsdp, self.ep, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_DIM_NAMES)
        mesh["efsdp", "ep"]._flatten("shard")
        if self.tp > 1:
            mesh["efsdp", "tp"]._flatten("expert_shard")
        return mesh

    def expert_dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1D mesh of the ranks that hold the same experts and route different tokens through them: efsdp,
        with TP the flattened (efsdp, tp) (under TP each rank routes its own sequence chunk)."""
        return _slice(mesh, "expert_shard" if self.tp > 1 else "efsdp")

    def expert_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """FSDP2's mesh for the experts: the expert-DP mesh, 2D with replicate under HSDP."""
        name = "expert_shard" if self.tp > 1 else "efsdp"
        return _slice(mesh, "replicate", name) if self.hsdp else _slice(mesh, name)

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """FSDP2's mesh: 2D (replicate, shard) for HSDP, else the 1D shard slice."""
        return _slice(mesh, "replicate", "shard") if self.hsdp else self.shard_mesh(mesh)

    def shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1D shard slice (DMuon's shard axis): a root dim, or under EP the flattened (efsdp, ep)."""
        return _slice(mesh, "shard")

    def dp_coordinates(self, mesh: DeviceMesh) -> tuple[int, int]:
        """(dp_rank, dp_world_size) of this process: the TP ranks of one DP group get the same data."""
        dp_rank = mesh.get_local_rank("replicate") * self.dp_shard + self.shard_mesh(mesh).get_local_rank()
        return dp_rank, self.dp_world_size

    def describe(self) -> str:
        ep = f" (ep {self.ep} x efsdp {self.efsdp})" if self.ep_enabled else ""
        return f"world {self.world_size} = replicate {self.dp_replicate} x shard {self.dp_shard}{ep} x tp {self.tp}"


def _slice(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """`mesh[names]`. Under EP some names are dims this module flattened from the root ("shard", "expert_shard"),
    which torch 2.13 slices from the root mesh with a deprecation warning asking callers to keep the flattened
    mesh themselves: these are the only slices of them, built here, so the warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[names[0]] if len(names) == 1 else mesh[names]
