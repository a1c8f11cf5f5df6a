"""Parallelism: ParallelDims -> the run's DeviceMeshes (Meshes); parallelize(model): TP -> EP -> AC -> compile ->
optimizer -> FSDP2, on the meta device (titan_dmuon/components/initialization.py then allocates each rank's share);
the distributed runtime (runtime.py: process groups, timeouts, heartbeat, teardown)."""

from .parallel_dims import EXPERT_MESH_DIM_NAMES, MESH_DIM_NAMES, Meshes, ParallelDims
from .parallelize import apply_ac, apply_compile, apply_fsdp, fsdp_blocks, parallelize

__all__ = [
    "EXPERT_MESH_DIM_NAMES",
    "MESH_DIM_NAMES",
    "Meshes",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "fsdp_blocks",
    "parallelize",
]
