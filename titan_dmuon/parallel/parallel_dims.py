"""Parallel degrees of a run and the one DeviceMesh every parallelism slices.

The mesh always has the three named dims ("replicate", "shard", "tp"), outermost first, even when a degree
is 1: every consumer slices by name (DMuon needs exactly "shard" and "replicate"), so no code path depends on
which degrees happen to be > 1, and a size-1 dim costs one trivial process group.

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    mesh["tp"]                   -> apply_tp
    mesh["shard"]                -> dmuon.dedicate_params(..., mesh["shard"], replicate_mesh=mesh["replicate"])
    dims.fsdp_mesh(mesh)         -> fully_shard: mesh["replicate", "shard"] (HSDP) or mesh["shard"]
    dims.dp_coordinates(mesh)    -> (dp_rank, dp_world_size) for the data loader (TP ranks share data)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_dmuon.config import JobConfig, validate_parallelism

MESH_DIM_NAMES = ("replicate", "shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the three mesh axes; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ValueError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x tp ({self.tp}) "
                f"!= world_size ({self.world_size})"
            )

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int, ranks_per_node: int | None = None) -> ParallelDims:
        """Resolve the configured degrees (shard = -1 takes the remaining ranks, replicate = "nodes" one replica per
        node of ranks_per_node ranks); raises ConfigError."""
        replicate, shard, tp = validate_parallelism(cfg, world_size, ranks_per_node)
        return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size)

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

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The run's DeviceMesh (replicate, shard, tp) over the default process group; the only place a mesh is
        built. Ranks are laid out row-major, so TP ranks are adjacent (same node)."""
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIM_NAMES)

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """FSDP2's mesh: 2D (replicate, shard) for HSDP, else the 1D shard slice."""
        return mesh["replicate", "shard"] if self.hsdp else mesh["shard"]

    def dp_coordinates(self, mesh: DeviceMesh) -> tuple[int, int]:
        """(dp_rank, dp_world_size) of this process: the TP ranks of one DP group get the same data."""
        dp_rank = mesh.get_local_rank("replicate") * self.dp_shard + mesh.get_local_rank("shard")
        return dp_rank, self.dp_world_size

    def describe(self) -> str:
        return f"world {self.world_size} = replicate {self.dp_replicate} x shard {self.dp_shard} x tp {self.tp}"
