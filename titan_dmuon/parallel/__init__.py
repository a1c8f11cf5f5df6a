"""Parallelism: ParallelDims -> one DeviceMesh; parallelize(model): TP -> AC -> compile -> optimizer -> FSDP2, on
the meta device (titan_dmuon/components/initialization.py then allocates each rank's share); the distributed
runtime (runtime.py: process groups, timeouts, heartbeat, teardown)."""

from .parallel_dims import MESH_DIM_NAMES, ParallelDims
from .parallelize import apply_ac, apply_compile, apply_fsdp, fsdp_blocks, parallelize

__all__ = [
    "MESH_DIM_NAMES",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "fsdp_blocks",
    "parallelize",
]
