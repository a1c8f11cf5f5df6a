"""Who owns what: one global LPT over every dedicated matrix (docs/dmuon.md, "The LPT partition").

Global, not per module: a per-layer LPT with 7 matrices on 8 ranks leaves one rank idle in every layer,
while the global view can hand that rank the layers where it happens to be lightest.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .costs import block_shape, matrix_ns_cost, ns_cost

# Matrices below this many elements in one layer share one owner and one packed broadcast.
SMALL_PARAM_THRESHOLD = 5_000_000


@dataclass(frozen=True)
class PartitionItem:
    """One dedicated matrix as the partitioner sees it."""

    name: str
    shape: tuple[int, ...]
    layer: str  # params of the same layer are spread over owners; small ones are merged per layer
    mergeable: bool = True  # TP-sharded params are never merged (each has its own gather/scatter)
    head_blocks: tuple[int, int] | None = None  # per-head Muon: (dim, size), NS on each block of `size` along `dim`


def item_cost(item: PartitionItem, ns_steps: int = 5) -> float:
    """NS work of one item (costs.matrix_ns_cost, the cost model's): `ns_cost` of its shape, or, with head blocks,
    blocks × `ns_cost` of a block; an expert stack, experts × `ns_cost` of one expert's matrix."""
    return matrix_ns_cost(item.shape, item.head_blocks, ns_steps)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def compute_balanced_assignment(
    items: Sequence[PartitionItem],
    num_slots: int,
    *,
    ns_steps: int = 5,
    small_param_threshold: int | None = None,
) -> dict[str, int]:
    """Assign every item to a slot in [0, num_slots), balancing NS cost; deterministic on every rank.

    Units: each large matrix is its own unit; the small matrices of one layer form one merged unit. A unit costs
    `item_cost` (a matrix with head blocks: blocks × the NS cost of one block).
    Units go, largest cost first (ties by name), to the least-loaded slot that holds no unit of the same
    layer yet; only when every slot already has that layer does the least-loaded slot overall take it.
    Ties between slots go to the lowest slot index.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        raise ValueError("compute_balanced_assignment: item names must be unique")
    threshold = SMALL_PARAM_THRESHOLD if small_param_threshold is None else small_param_threshold

    units: list[tuple[float, str, str, list[str]]] = []  # (cost, key, layer, members)
    merged: dict[str, list[PartitionItem]] = {}
    for it in items:
        if it.mergeable and _numel(it.shape) < threshold:
            merged.setdefault(it.layer, []).append(it)
        else:
            units.append((item_cost(it, ns_steps), it.name, it.layer, [it.name]))
    for layer, members in merged.items():
        members = sorted(members, key=lambda m: m.name)
        cost = sum(item_cost(m, ns_steps) for m in members)
        units.append((cost, members[0].name, layer, [m.name for m in members]))
    units.sort(key=lambda u: (-u[0], u[1]))

    heap = [(0.0, slot) for slot in range(num_slots)]  # (load, slot): pops least loaded, lowest index
    layers_of_slot: list[set[str]] = [set() for _ in range(num_slots)]
    assignment: dict[str, int] = {}
    for cost, _key, layer, members in units:
        skipped = []
        while heap and layer in layers_of_slot[heap[0][1]]:
            skipped.append(heapq.heappop(heap))
        load, slot = heapq.heappop(heap) if heap else skipped.pop(0)
        for entry in skipped:
            heapq.heappush(heap, entry)
        layers_of_slot[slot].add(layer)
        heapq.heappush(heap, (load + cost, slot))
        for name in members:
            assignment[name] = slot
    return assignment


def makespan_lower_bound(costs: Sequence[float], num_slots: int) -> float:
    """A certified lower bound on the largest slot load of ANY assignment of these indivisible jobs to
    `num_slots` slots: max(mean, largest, p_N + p_{N+1}) with p_1 >= p_2 >= ... (some slot carries the mean;
    some slot holds the largest job; two of the N+1 largest jobs share a slot). LPT's makespan / this bound
    measures how far from optimal a plan can be at most."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    p = sorted((float(c) for c in costs), reverse=True)
    if not p:
        return 0.0
    bound = max(sum(p) / num_slots, p[0])
    if len(p) > num_slots:
        bound = max(bound, p[num_slots - 1] + p[num_slots])
    return bound


def slot_loads(
    items: Sequence[PartitionItem], assignment: dict[str, int], num_slots: int, ns_steps: int = 5
) -> list[float]:
    """NS cost per slot under an assignment (for balance reports and tests)."""
    loads = [0.0] * num_slots
    for it in items:
        loads[assignment[it.name]] += item_cost(it, ns_steps)
    return loads


# ns_cost and block_shape are the cost model's (costs.py), importable from here as before.
__all__ = [
    "SMALL_PARAM_THRESHOLD",
    "PartitionItem",
    "block_shape",
    "compute_balanced_assignment",
    "item_cost",
    "makespan_lower_bound",
    "ns_cost",
    "slot_loads",
]
