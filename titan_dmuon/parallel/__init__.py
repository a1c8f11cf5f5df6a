"""Parallelism: ParallelDims -> one DeviceMesh; parallelize(model): TP -> AC -> compile -> optimizer -> FSDP2, on
the meta device; materialize(model): each rank allocates and initializes its share."""

from .materialize import global_index, materialize
from .parallel_dims import MESH_DIM_NAMES, ParallelDims
from .parallelize import apply_ac, apply_compile, apply_fsdp, fsdp_blocks, parallelize

__all__ = [
    "MESH_DIM_NAMES",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "fsdp_blocks",
    "global_index",
    "materialize",
    "parallelize",
]
