"""DMuon's cost model: what one step costs, as plain functions of shapes, element sizes and degrees.

One statement of each formula, for the optimizer and for whoever plans a run without running it:

- communication (docs/dmuon.md, "Bytes per step"): `collective_elements` is what the ledger (comm.py) counts for
  each collective it issues; `shard_axis`, `replicate_axis`, `tp_update` and `tp_gram` are one dedicated matrix's
  (or a set of matrices', the formulas being linear) per-rank share of each ledger kind, `Traffic.bytes` its bytes;
- Newton-Schulz work (docs/dmuon.md, "The LPT partition"): `ns_flops` (the direct formulation's matmul FLOPs),
  `ns_cost` (half of it: the partitioner's unit), `matrix_ns_cost` of a matrix split into head blocks or experts,
  which partition.py balances;
- the paths a matrix's update takes: `update_blocks` (expert stacks by expert, per-head Muon by head),
  `heads_are_local` and `tp_decision` / `tp_path` (which TP matrices need a gather/scatter or a distributed Gram,
  under `tp_distributed_gram_policy`: `gram_is_beneficial` compares the two paths' bytes), which dmuon.Muon, its
  layout printout and the planner all follow.

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


TP_GRAM_POLICIES = ("beneficial", "always", "never")
"""`tp_distributed_gram_policy`'s values (docs/dmuon.md, "tp_distributed_gram"): which TP matrices that can take the
distributed Gram ("gram" path) take it: "beneficial" (the default) those whose Gram all-reduces move fewer bytes
than gathering and scattering their full update, "always" every one, "never" none."""


def check_tp_gram_policy(policy: object) -> str:
    """`policy` when it is one of TP_GRAM_POLICIES, else a ValueError naming it and the choices."""
    if not isinstance(policy, str) or policy not in TP_GRAM_POLICIES:
        choices = ", ".join(repr(p) for p in TP_GRAM_POLICIES)
        raise ValueError(f"tp_distributed_gram_policy must be one of {choices}, got {policy!r}")
    return policy


def gram_split_dim(full_shape: Sequence[int]) -> int:
    """The dim a matrix's TP shards must split for the distributed Gram: the long side, along which the blocks'
    partial Gram matrices add up (X Xᵀ = Σ X_i X_iᵀ for X = [X_1 ... X_T]). NS iterates on a wide or square matrix
    as it is and on a tall one transposed, so: 1 for a wide or square matrix, 0 for a tall one. A square matrix
    split on dim 0 (a column-parallel wq) cannot take it."""
    return 0 if int(full_shape[0]) > int(full_shape[1]) else 1


def gram_is_beneficial(full_shape: Sequence[int], tp_size: int, restarts: Sequence[int]) -> bool:
    """Whether the distributed Gram of a matrix TP-split on its long side moves fewer bytes per rank than the
    gather path: `tp_gram` (one s×s fp32 all-reduce per restart segment, 2(T-1)/T of it per rank) against
    `tp_update` (the full m×n fp32 update gathered and scattered, (T-1)/T of it each). The (T-1)/T cancels:
    the Gram path pays iff (1 + len(restarts))·s < l, s the short side and l the long one (docs/dmuon.md,
    "tp_distributed_gram"); a tie keeps the gather (the exact direct NS)."""
    s, long = sorted(int(d) for d in full_shape[:2])
    gram = tp_gram(s, tp_size, restarts).total
    return gram < tp_update(s * long, tp_size).total


@dataclass(frozen=True)
class TPDecision:
    """`tp_decision`: a matrix's path, why, and (for a matrix that could take the Gram) both paths' fp32 bytes per
    TP rank of its DP owner and step (0 where they do not apply)."""

    path: TPPath
    reason: str
    gram_bytes: float = 0.0
    gather_bytes: float = 0.0


def tp_decision(
    full_shape: Sequence[int],
    local_shape: Sequence[int],
    shard_dim: int | None,
    head_blocks: tuple[int, int] | None,
    *,
    distributed_gram: bool,
    policy: str = "beneficial",
    restarts: Sequence[int] | None = None,
) -> TPDecision:
    """How a matrix's Newton-Schulz runs, and why (`tp_path` is its `path`):

    - "local": not TP-sharded, or its TP shards hold whole blocks (per-head Muon, experts): each rank its own;
    - "gram": `distributed_gram` on, the whole matrix (no blocks) TP-split on `gram_split_dim`, and the `policy`
      (TP_GRAM_POLICIES) takes it: "always", or "beneficial" where `gram_is_beneficial` (`restarts`, the Gram NS's
      restarts, dmuon.gram_restarts, then needed: they set how many all-reduces the Gram path issues);
    - "gather" otherwise: onto the TP owner and back (`tp_update`). "always" falls back to it for a matrix that
      cannot take the Gram (split on its short side, square split on dim 0, blocked) rather than refuse the run.
    `head_blocks`: the blocks of `update_blocks`. ValueError for an unknown `policy`."""
    check_tp_gram_policy(policy)
    if shard_dim is None:
        return TPDecision("local", "not TP-sharded")
    if head_blocks is not None and heads_are_local(local_shape, shard_dim, head_blocks):
        return TPDecision("local", "its TP shard holds whole blocks")
    if not distributed_gram:
        return TPDecision("gather", "tp_distributed_gram off")
    if head_blocks is not None:
        return TPDecision("gather", "orthogonalized by blocks (the Gram would be the whole matrix's)")
    split = gram_split_dim(full_shape)
    if shard_dim != split:
        what = "square" if int(full_shape[0]) == int(full_shape[1]) else "short side"
        return TPDecision("gather", f"TP-split on dim {shard_dim}, {what}: the Gram path needs dim {split} split")
    if policy == "never":
        return TPDecision("gather", "policy 'never'")
    tp_size = int(full_shape[shard_dim]) // int(local_shape[shard_dim])
    s, long = sorted(int(d) for d in full_shape[:2])
    gather_bytes = tp_update(s * long, tp_size).total * MASTER_ITEMSIZE
    if restarts is None:
        if policy == "always":
            return TPDecision("gram", "policy 'always'", gather_bytes=gather_bytes)
        raise ValueError("tp_decision: the 'beneficial' policy needs the Gram restarts (dmuon.gram_restarts)")
    segments = 1 + len(restarts)
    gram_bytes = tp_gram(s, tp_size, restarts).total * MASTER_ITEMSIZE
    if policy == "always":
        return TPDecision("gram", "policy 'always'", gram_bytes, gather_bytes)
    if gram_is_beneficial(full_shape, tp_size, restarts):
        why = f"l/s = {long / s:.3g} > {segments} Gram all-reduces: the Gram moves less"
        return TPDecision("gram", why, gram_bytes, gather_bytes)
    why = f"l/s = {long / s:.3g} <= {segments} Gram all-reduces: the Gram would move more"
    return TPDecision("gather", why, gram_bytes, gather_bytes)


def tp_path(
    full_shape: Sequence[int],
    local_shape: Sequence[int],
    shard_dim: int | None,
    head_blocks: tuple[int, int] | None,
    *,
    distributed_gram: bool,
    policy: str = "beneficial",
    restarts: Sequence[int] | None = None,
) -> TPPath:
    """`tp_decision`'s path: "local", "gram" or "gather" (what dmuon.Muon and the planner follow)."""
    return tp_decision(
        full_shape,
        local_shape,
        shard_dim,
        head_blocks,
        distributed_gram=distributed_gram,
        policy=policy,
        restarts=restarts,
    ).path


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

    def tp_decision(
        self, distributed_gram: bool = False, policy: str = "beneficial", restarts: Sequence[int] | None = None
    ) -> TPDecision:
        return tp_decision(
            self.full_shape,
            self.local_shape,
            self.shard_dim,
            self.head_blocks,
            distributed_gram=distributed_gram,
            policy=policy,
            restarts=restarts,
        )

    def tp_path(
        self, distributed_gram: bool = False, policy: str = "beneficial", restarts: Sequence[int] | None = None
    ) -> TPPath:
        return self.tp_decision(distributed_gram, policy, restarts).path


__all__ = [
    "ALL_REDUCE",
    "EXPERT_BLOCKS",
    "KINDS",
    "MASTER_ITEMSIZE",
    "TP_GRAM_POLICIES",
    "Matrix",
    "TPDecision",
    "TPPath",
    "Traffic",
    "block_shape",
    "check_tp_gram_policy",
    "collective_elements",
    "gram_is_beneficial",
    "gram_split_dim",
    "heads_are_local",
    "itemsize",
    "matrix_ns_cost",
    "matrix_ns_flops",
    "ns_cost",
    "ns_flops",
    "num_blocks",
    "replicate_axis",
    "shard_axis",
    "tp_decision",
    "tp_gram",
    "tp_path",
    "tp_update",
    "update_blocks",
]
