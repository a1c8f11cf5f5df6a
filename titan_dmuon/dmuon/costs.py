"""DMuon's cost model: what one step costs, as plain functions of shapes, element sizes and degrees.

One statement of each formula, for the optimizer and for whoever plans a run without running it:

- communication (docs/dmuon.md, "Bytes per step"): `collective_elements` is what the ledger (comm.py) counts for
  each collective it issues; `shard_axis`, `replicate_axis`, `tp_update` and `tp_gram` are one dedicated matrix's
  (or a set of matrices', the formulas being linear) per-rank share of each ledger kind, `Traffic.bytes` its bytes;
- Newton-Schulz work (docs/dmuon.md, "The LPT partition"): `ns_flops` (the direct formulation's matmul FLOPs),
  `ns_cost` (half of it: the partitioner's unit), `matrix_ns_cost` of a matrix split into head blocks or experts,
  which partition.py balances;
- the paths a matrix's update takes: `update_blocks` (expert stacks by expert, per-head Muon by head),
  `heads_are_local` and `tp_path` (which TP matrices need a gather/scatter or a distributed Gram), which
  dmuon.Muon follows.

`dmuon.dedicated_matrices(model)` (api.py) reads a model's dedicated matrices into plain `Matrix` records, so that a
planner (the dry run, titan_dmuon/planner/) sums these functions over a model it never steps.

This module imports nothing from the rest of the library: comm.py, partition.py and muon.py import it. Element sizes
are ints or anything with an `itemsize` (a torch.dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# The ledger's kinds, in reporting order (comm.CommLedger refuses any other).
KINDS = ("broadcast", "reduce", "replicate_reduce", "replicate_broadcast", "tp_gather", "tp_scatter", "tp_gram")

ALL_REDUCE = 2
"""`collective_elements`' factor for an all-reduce: a ring moves 2(k-1)/k of the tensor per rank."""

MASTER_ITEMSIZE = 4
"""Bytes of an element of the fp32 masters, momentum and reduced grads, and of what moves them: the publish, the
TP gathers and scatters, the TP Gram."""

EXPERT_BLOCKS = (0, 1)
"""The blocks of an expert stack (experts x out x in): one per expert along dim 0, each an out x in matrix."""

TPPath = Literal["local", "gram", "gather"]


def itemsize(element: int | object) -> int:
    """Bytes per element: `element` itself (an int) or its `itemsize` (a torch.dtype)."""
    return int(getattr(element, "itemsize", element))


# ------------------------------------------------------------------------------------------------ communication
def collective_elements(numel: float, group_size: int, factor: int = 1) -> float:
    """Elements one collective of `numel` elements over `group_size` ranks counts on each of them: (k-1)/k·numel for
    a broadcast, reduce, gather or scatter (the per-rank traffic of a bandwidth-optimal pipelined or ring
    implementation), `factor` = ALL_REDUCE for an all-reduce; 0 on a group of one rank."""
    return factor * (group_size - 1) / group_size * numel


@dataclass(frozen=True)
class Traffic:
    """Per-rank elements (or bytes) of DMuon's collectives in one step, by ledger kind (KINDS). Linear: add the
    matrices' figures to get a rank's (the functions below also take numpy arrays, one value per rank)."""

    broadcast: float = 0.0
    reduce: float = 0.0
    replicate_reduce: float = 0.0
    replicate_broadcast: float = 0.0
    tp_gather: float = 0.0
    tp_scatter: float = 0.0
    tp_gram: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(**{k: getattr(self, k) + getattr(other, k) for k in KINDS})

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in KINDS}

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in KINDS)

    def bytes(self, param_itemsize: int | object, reduce_itemsize: int | object) -> Traffic:
        """These elements in bytes, each kind in what it moves: the packed parameter buffers (`broadcast`) in the
        param dtype, the packed gradients (`reduce`, `replicate_reduce`) in the reduce dtype, the rest (the
        publish of the fp32 masters, the TP update shards, the TP Gram) in fp32."""
        e_param, e_reduce = itemsize(param_itemsize), itemsize(reduce_itemsize)
        size = {"broadcast": e_param, "reduce": e_reduce, "replicate_reduce": e_reduce}
        return Traffic(**{k: getattr(self, k) * size.get(k, MASTER_ITEMSIZE) for k in KINDS})


def shard_axis(numel: float, shard_size: int, *, z3: bool, matrices: int = 1) -> Traffic:
    """On every rank of the shard group that owns them: the forward broadcast of `numel` elements of dedicated
    matrices (Z3: once more before backward) and the backward reduce of their grads, which carries one has-grad
    flag per matrix (`matrices` of them): Z2 2(N-1)/N·P, Z3 3(N-1)/N·P (+ the flags)."""
    return Traffic(
        broadcast=(2 if z3 else 1) * collective_elements(numel, shard_size),
        reduce=collective_elements(numel + matrices, shard_size),
    )


def replicate_axis(numel: float, replicate_size: int, *, matrices: int = 1) -> Traffic:
    """On every rank of the owner column (HSDP; DDP's replicate axis): the stage-2 reduce of the column's
    matrices (`numel` elements, with one has-grad flag per matrix) onto their global owners and the post-step
    publish of the owners' fp32 masters, each (R-1)/R of them."""
    return Traffic(
        replicate_reduce=collective_elements(numel + matrices, replicate_size),
        replicate_broadcast=collective_elements(numel, replicate_size),
    )


def tp_update(full_numel: float, tp_size: int) -> Traffic:
    """On each TP rank of a TP-sharded matrix's DP owner (the "gather" path of `tp_path`): the gather of its
    update shards onto the TP owner and the scatter of the orthogonalized ones, (T-1)/T of the full matrix each."""
    return Traffic(
        tp_gather=collective_elements(full_numel, tp_size), tp_scatter=collective_elements(full_numel, tp_size)
    )


def tp_gram(short_side: int, tp_size: int, restarts: Sequence[int]) -> Traffic:
    """On each TP rank of a TP-sharded matrix's DP owner (the "gram" path of `tp_path`): one all-reduce of the
    s×s fp32 Gram matrix per restart segment of its NS, the first one's and one per restart (`restarts`: the
    steps before which the Gram formulation restarts, dmuon.gram_restarts)."""
    s = int(short_side)
    return Traffic(tp_gram=(1 + len(restarts)) * collective_elements(s * s, tp_size, ALL_REDUCE))


# ---------------------------------------------------------------------------------------------- Newton-Schulz
def ns_flops(shape: Sequence[int], ns_steps: int) -> float:
    """Matmul FLOPs of the direct formulation on an (m, n) matrix (s = short side, long = long side)."""
    s, long = sorted(int(d) for d in shape[:2])
    return 2.0 * ns_steps * (2 * s * s * long + s * s * s)


def ns_cost(shape: Sequence[int], ns_steps: int = 5) -> float:
    """The partitioner's NS work of an s×l matrix (s the short side): ns_steps·s²·(2l+s), half `ns_flops`."""
    return ns_flops(shape, ns_steps) / 2


def update_blocks(shape: Sequence[int], head_blocks: tuple[int, int] | None) -> tuple[int, int] | None:
    """The blocks Muon orthogonalizes a matrix's update in: an expert stack (3D) by expert, always; a matrix by
    its active head blocks (per-head Muon), or whole (None)."""
    return EXPERT_BLOCKS if len(shape) == 3 else head_blocks


def block_shape(shape: Sequence[int], head_blocks: tuple[int, int] | None) -> tuple[int, int]:
    """The shape of one head block of a matrix of `shape` split into blocks of `size` along `dim` (the matrix's own
    shape without blocks); of an expert stack (3D: experts x out x in), one expert's matrix."""
    if len(shape) == 3:
        return int(shape[1]), int(shape[2])
    out = [int(shape[0]), int(shape[1])]
    if head_blocks is not None:
        out[head_blocks[0]] = int(head_blocks[1])
    return out[0], out[1]


def num_blocks(shape: Sequence[int], head_blocks: tuple[int, int] | None) -> int:
    """How many blocks of `head_blocks` a matrix of `shape` has (1: the whole matrix)."""
    return 1 if head_blocks is None else int(shape[head_blocks[0]]) // int(head_blocks[1])


def matrix_ns_cost(shape: Sequence[int], head_blocks: tuple[int, int] | None = None, ns_steps: int = 5) -> float:
    """`ns_cost` of a dedicated matrix: of its shape, or, with head blocks, blocks × `ns_cost` of a block; an expert
    stack, experts × `ns_cost` of one expert's matrix."""
    blocks = update_blocks(shape, head_blocks)
    return num_blocks(shape, blocks) * ns_cost(block_shape(shape, blocks), ns_steps)


def matrix_ns_flops(shape: Sequence[int], head_blocks: tuple[int, int] | None = None, ns_steps: int = 5) -> float:
    """`ns_flops` of a dedicated matrix (as `matrix_ns_cost` splits it)."""
    blocks = update_blocks(shape, head_blocks)
    return num_blocks(shape, blocks) * ns_flops(block_shape(shape, blocks), ns_steps)


# ------------------------------------------------------------------------------------------- the update's path
def heads_are_local(local_shape: Sequence[int], shard_dim: int | None, head_blocks: tuple[int, int]) -> bool:
    """Per-head Muon (an expert stack's experts alike): whether every block of a TP-sharded matrix lies whole in one
    TP shard, so each TP rank orthogonalizes its own shard's blocks with no gather or scatter. True when the
    blocked dim is the TP shard dim and the local (shard) size along it is a multiple of the block size (wq/wk/wv
    column-parallel by whole heads on dim 0, wo row-parallel by whole heads on dim 1); otherwise a head straddles
    two TP ranks (docs/dmuon.md, "Per-head Muon"). False for a matrix that is not TP-sharded (`shard_dim` None)."""
    dim, size = head_blocks
    return shard_dim is not None and dim == shard_dim and int(local_shape[dim]) % size == 0


def gram_is_beneficial(full_shape: Sequence[int], shard_dim: int | None) -> bool:
    """Distributed Gram pays when the TP-sharded dim is the long side: the s×s Gram all-reduce is then smaller than
    gathering and scattering the full m×n update (docs/dmuon.md, "Tensor parallelism")."""
    m, n = int(full_shape[0]), int(full_shape[1])
    long_dim = 0 if m > n else 1 if n > m else None
    return long_dim is not None and shard_dim == long_dim


def tp_path(
    full_shape: Sequence[int],
    local_shape: Sequence[int],
    shard_dim: int | None,
    head_blocks: tuple[int, int] | None,
    *,
    distributed_gram: bool,
) -> TPPath:
    """How a matrix's Newton-Schulz runs: "local" (not TP-sharded, or its TP shards hold whole blocks: each rank
    its own, no TP traffic), "gram" (`distributed_gram`, whole-matrix NS, the TP-sharded dim the long side: the
    TP ranks iterate on the s×s Gram, `tp_gram`), else "gather" (onto the TP owner and back, `tp_update`).
    `head_blocks`: the blocks of `update_blocks`."""
    if shard_dim is None or (head_blocks is not None and heads_are_local(local_shape, shard_dim, head_blocks)):
        return "local"
    if distributed_gram and head_blocks is None and gram_is_beneficial(full_shape, shard_dim):
        return "gram"
    return "gather"


# ------------------------------------------------------------------------------------------- a model's matrices
@dataclass(frozen=True)
class Matrix:
    """One dedicated matrix as the cost model sees it: plain values, the same on every rank."""

    fqn: str
    full_shape: tuple[int, ...]  # the logical matrix (an expert stack under EP: every expert)
    local_shape: tuple[int, ...]  # what each rank holds of it: its TP (or EP) shard, or the whole
    owner_shard: int  # the owner's coordinate on the shard axis it is owned over (an expert stack: expert shard)
    owner_replicate: int
    shard_dim: int | None = None  # the TP-sharded dim (an expert stack under EP: 0), None when not sharded
    tp_owner: int = 0  # the TP rank that runs its NS on the "gather" path
    head_blocks: tuple[int, int] | None = None  # `update_blocks`: what its NS runs on
    expert: bool = False  # owned over the expert axes (expert parallelism), not the dense ones
    group: int = 0  # its packed group (forward order)
    hook: str = ""  # the module whose hooks move its group
    param_itemsize: int = 4  # bytes per element of its packed parameter buffer (the broadcasts)
    reduce_itemsize: int = 4  # of its packed gradient buffer (the reduces)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def tp_size(self) -> int:
        """The ranks its TP (an expert stack: EP) shards are spread over (1 when not sharded)."""
        return 1 if self.shard_dim is None else self.full_shape[self.shard_dim] // self.local_shape[self.shard_dim]

    def ns_cost(self, ns_steps: int = 5) -> float:
        return matrix_ns_cost(self.full_shape, self.head_blocks, ns_steps)

    def ns_flops(self, ns_steps: int = 5) -> float:
        return matrix_ns_flops(self.full_shape, self.head_blocks, ns_steps)

    def tp_path(self, distributed_gram: bool = False) -> TPPath:
        return tp_path(
            self.full_shape, self.local_shape, self.shard_dim, self.head_blocks, distributed_gram=distributed_gram
        )


__all__ = [
    "ALL_REDUCE",
    "EXPERT_BLOCKS",
    "KINDS",
    "MASTER_ITEMSIZE",
    "Matrix",
    "TPPath",
    "Traffic",
    "block_shape",
    "collective_elements",
    "gram_is_beneficial",
    "heads_are_local",
    "itemsize",
    "matrix_ns_cost",
    "matrix_ns_flops",
    "ns_cost",
    "ns_flops",
    "num_blocks",
    "replicate_axis",
    "shard_axis",
    "tp_gram",
    "tp_path",
    "tp_update",
    "update_blocks",
]
