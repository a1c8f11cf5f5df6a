"""Global LPT partitioner (titan_dmuon.dmuon.partition) against its specification."""

import random

import pytest

from titan_dmuon.dmuon import partition
from titan_dmuon.dmuon.partition import (
    SMALL_PARAM_THRESHOLD,
    PartitionItem,
    compute_balanced_assignment,
    ns_cost,
    slot_loads,
)

# ----------------------------------------------------------------------------------------------------------
# helpers


def llama3_items(dim: int, n_layers: int, n_kv_heads: int, ffn: int, head_dim: int = 128) -> list[PartitionItem]:
    """The dedicated matrices of a Llama-3 model: 7 per transformer block, as nn.Linear weights (out, in)."""
    kv = n_kv_heads * head_dim
    shapes = {
        "attention.wq.weight": (dim, dim),
        "attention.wk.weight": (kv, dim),
        "attention.wv.weight": (kv, dim),
        "attention.wo.weight": (dim, dim),
        "feed_forward.w1.weight": (ffn, dim),
        "feed_forward.w2.weight": (dim, ffn),
        "feed_forward.w3.weight": (ffn, dim),
    }
    return [PartitionItem(f"layers.{i}.{k}", s, f"layers.{i}") for i in range(n_layers) for k, s in shapes.items()]


LLAMA3_8B = dict(dim=4096, n_layers=32, n_kv_heads=8, ffn=14336)
LLAMA3_70B = dict(dim=8192, n_layers=80, n_kv_heads=8, ffn=28672)


def reference_lpt(items, num_slots, ns_steps=5, threshold=SMALL_PARAM_THRESHOLD):
    """Independent, deliberately naive O(units·slots) implementation of the specified LPT."""
    units = []  # (cost, key, layer, members)
    small: dict[str, list[PartitionItem]] = {}
    for it in items:
        n = 1
        for d in it.shape:
            n *= d
        if n < threshold:
            small.setdefault(it.layer, []).append(it)
        else:
            units.append((ns_cost(it.shape, ns_steps), it.name, it.layer, [it.name]))
    for layer, members in small.items():
        members = sorted(members, key=lambda m: m.name)
        units.append(
            (sum(ns_cost(m.shape, ns_steps) for m in members), members[0].name, layer, [m.name for m in members])
        )
    units.sort(key=lambda u: (-u[0], u[1]))
    loads = [0.0] * num_slots
    layers = [set() for _ in range(num_slots)]
    out = {}
    for cost, _, layer, members in units:
        free = [s for s in range(num_slots) if layer not in layers[s]]
        cands = free if free else list(range(num_slots))
        slot = min(cands, key=lambda s: (loads[s], s))
        loads[slot] += cost
        layers[slot].add(layer)
        for m in members:
            out[m] = slot
    return out


def lower_bound(items, num_slots, ns_steps=5):
    """A valid lower bound on the max slot load of ANY assignment of these items (units only coarsen it).

    LB = max(mean, p_1, p_N + p_{N+1}) with p_1 >= p_2 >= ... the item costs and N = num_slots:
      * some slot carries at least the mean load;
      * the slot holding the largest item carries at least p_1;
      * pigeonhole: the N+1 largest items occupy at most N slots, so two of them share a slot, and any two of
        them cost at least the two smallest among them, p_N + p_{N+1}.
    Merging small params into one unit only removes assignments, so LB stays valid for the unit problem.
    """
    costs = sorted((ns_cost(it.shape, ns_steps) for it in items), reverse=True)
    lb = max(sum(costs) / num_slots, costs[0])
    if len(costs) > num_slots:
        lb = max(lb, costs[num_slots - 1] + costs[num_slots])
    return lb


# ----------------------------------------------------------------------------------------------------------
# cost model


def test_threshold_constant():
    assert SMALL_PARAM_THRESHOLD == 5_000_000
    assert partition.SMALL_PARAM_THRESHOLD == 5_000_000


@pytest.mark.parametrize(
    "shape,steps,want",
    [
        ((4, 10), 5, 5 * 16 * (20 + 4)),  # wide: s=4, l=10
        ((10, 4), 5, 5 * 16 * (20 + 4)),  # tall: same as its transpose
        ((7, 7), 3, 3 * 49 * (14 + 7)),  # square
        ((1, 1000), 1, 1 * 1 * (2000 + 1)),
        ((4096, 14336), 5, 5 * 4096**2 * (2 * 14336 + 4096)),
    ],
)
def test_ns_cost(shape, steps, want):
    assert ns_cost(shape, steps) == float(want)
    assert isinstance(ns_cost(shape, steps), float)


def test_ns_cost_default_steps_is_5():
    assert ns_cost((3, 8)) == 5 * 9 * (16 + 3)


# ----------------------------------------------------------------------------------------------------------
# LPT semantics on hand-checked examples


def test_lpt_hand_example_one_layer_per_item():
    # distinct layers (no spreading constraint), big enough to stay separate units (threshold 1)
    sizes = {"a": 10, "b": 9, "c": 8, "d": 7, "e": 6, "f": 1}
    items = [PartitionItem(n, (1, k), n) for n, k in sizes.items()]  # ns_cost((1,k),1) = 2k+1
    got = compute_balanced_assignment(items, 3, ns_steps=1, small_param_threshold=1)
    # LPT: a(21)->0, b(19)->1, c(17)->2, d(15)->2 (17 least), e(13)->1 (19 < 21), f(3)->0 (21 < 32 = 19+13)
    assert got == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 1, "f": 0}
    assert slot_loads(items, got, 3, ns_steps=1) == [24.0, 32.0, 32.0]


def test_ties_go_to_lowest_slot_and_by_name():
    # four equal items, four slots: sorted by name, each to the lowest-index empty slot
    items = [PartitionItem(n, (8, 8), n) for n in ["d", "b", "a", "c"]]
    got = compute_balanced_assignment(items, 4, small_param_threshold=1)
    assert got == {"a": 0, "b": 1, "c": 2, "d": 3}
    # five equal items on two slots: a->0, b->1, c->0, d->1, e->0
    items = [PartitionItem(n, (8, 8), n) for n in ["e", "c", "a", "d", "b"]]
    got = compute_balanced_assignment(items, 2, small_param_threshold=1)
    assert got == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}


def test_same_layer_avoided_even_if_least_loaded():
    # slot 1 ends up least loaded but already holds layer L; the next L unit must go to slot 0 instead
    items = [
        PartitionItem("x", (1, 100), "X"),  # cost 201 -> slot 0
        PartitionItem("l1", (1, 50), "L"),  # cost 101 -> slot 1
        PartitionItem("l2", (1, 40), "L"),  # cost 81: slot 1 (101) is lighter, but holds L -> slot 0
    ]
    got = compute_balanced_assignment(items, 2, ns_steps=1, small_param_threshold=1)
    assert got == {"x": 0, "l1": 1, "l2": 0}
    assert got == reference_lpt(items, 2, ns_steps=1, threshold=1)


def test_layer_on_every_slot_falls_back_to_least_loaded_overall():
    # 3 units of one layer on 2 slots: the third goes to the least loaded slot
    items = [
        PartitionItem("a", (1, 100), "L"),  # 201 -> 0
        PartitionItem("b", (1, 60), "L"),  # 121 -> 1
        PartitionItem("c", (1, 10), "L"),  # 21  -> every slot has L -> least loaded overall = 1
    ]
    got = compute_balanced_assignment(items, 2, ns_steps=1, small_param_threshold=1)
    assert got == {"a": 0, "b": 1, "c": 1}
    assert slot_loads(items, got, 2, ns_steps=1) == [201.0, 142.0]


def test_same_layer_spread_four_large_matrices_four_slots():
    big = (2304, 2304)  # 5,308,416 elements >= 5M: each is its own unit
    assert big[0] * big[1] >= SMALL_PARAM_THRESHOLD
    # a heavy other-layer matrix first so that plain LPT (without the layer rule) would stack layer L
    items = [PartitionItem("other.w", (4096, 4096), "other")]
    items += [PartitionItem(f"L.w{i}", big, "L") for i in range(4)]
    got = compute_balanced_assignment(items, 4)
    assert sorted(got[f"L.w{i}"] for i in range(4)) == [0, 1, 2, 3]
    # and with only the layer, trivially spread as well
    got = compute_balanced_assignment(items[1:], 4)
    assert sorted(got.values()) == [0, 1, 2, 3]


def test_layer_rule_on_mixed_layers():
    # Two slots; unit costs: A(layer L)=huge, B(layer M)=big, C(layer L) small.
    # Least loaded after A,B is slot 1 (M) -> C goes there (no L on it): also the plain-LPT choice.
    # Then D (layer M): least loaded is slot 1 but it has M -> slot 0.
    big = (2304, 2304)
    items = [
        PartitionItem("A", (4096, 4096), "L"),
        PartitionItem("B", (3000, 3000), "M"),
        PartitionItem("C", big, "L"),
        PartitionItem("D", big, "M"),
    ]
    got = compute_balanced_assignment(items, 2)
    assert got == {"A": 0, "B": 1, "C": 1, "D": 0}
    assert got == reference_lpt(items, 2)


def test_small_params_of_one_layer_share_one_slot():
    items = []
    for layer in range(6):
        items += [
            PartitionItem(f"layers.{layer}.wq", (3000, 3000), f"layers.{layer}"),  # 9M: large
            PartitionItem(f"layers.{layer}.wk", (256, 3000), f"layers.{layer}"),  # 768k: small
            PartitionItem(f"layers.{layer}.wv", (256, 3000), f"layers.{layer}"),
            PartitionItem(f"layers.{layer}.norm", (1, 3000), f"layers.{layer}"),
            PartitionItem(f"layers.{layer}.gate", (64, 64), f"layers.{layer}"),
        ]
    got = compute_balanced_assignment(items, 4)
    for layer in range(6):
        smalls = {got[f"layers.{layer}.{k}"] for k in ("wk", "wv", "norm", "gate")}
        assert len(smalls) == 1, (layer, smalls)
        # the merged unit never lands with its own layer's large matrix while another slot is free of it
        assert smalls != {got[f"layers.{layer}.wq"]}
    assert got == reference_lpt(items, 4)
    # small units of different layers are different units. Worked by hand: the 6 wq go to 0,1,2,3,0,1, so slots
    # 2 and 3 are lightest; merged units (equal cost, keyed "layers.N.gate") then alternate between 2 and 3,
    # skipping the slot that already holds their layer's wq (layer 2 -> not 2, layer 3 -> not 3).
    assert [got[f"layers.{i}.wk"] for i in range(6)] == [2, 3, 3, 2, 2, 3]
    assert [got[f"layers.{i}.wq"] for i in range(6)] == [0, 1, 2, 3, 0, 1]


def test_small_merge_unit_cost_is_sum():
    # one layer: two small matrices merged (cost 2x) vs one large matrix (cost 1.5x): merged goes first
    s = (100, 100)  # 10k elements
    items = [
        PartitionItem("z.small1", s, "Z"),
        PartitionItem("z.small2", s, "Z"),
        PartitionItem("y.big", (100, 150), "Y"),  # cost 5*100^2*(300+100) < 2*5*100^2*300
    ]
    got = compute_balanced_assignment(items, 2, small_param_threshold=12_000)
    assert got == {"z.small1": 0, "z.small2": 0, "y.big": 1}


def test_threshold_boundary_numel_equal_is_large():
    # numel == threshold is NOT small: two such matrices of one layer spread, numel-1 ones merge
    items = [PartitionItem("a", (10, 10), "L"), PartitionItem("b", (10, 10), "L")]
    assert len(set(compute_balanced_assignment(items, 2, small_param_threshold=100).values())) == 2
    assert len(set(compute_balanced_assignment(items, 2, small_param_threshold=101).values())) == 1


def test_all_large_layer_is_spread():
    # a layer made only of large matrices (no small unit): 7 matrices over 8 slots -> 7 distinct slots
    items = llama3_items(**{**LLAMA3_70B, "n_layers": 1})
    got = compute_balanced_assignment(items, 8)
    assert len(set(got.values())) == 7
    # 8B: wk, wv (4M elements) are small and merge; 5 large + 1 merged unit -> 6 distinct slots
    items = llama3_items(**{**LLAMA3_8B, "n_layers": 1})
    got = compute_balanced_assignment(items, 8)
    assert got["layers.0.attention.wk.weight"] == got["layers.0.attention.wv.weight"]
    assert len(set(got.values())) == 6


def test_single_slot_and_errors():
    items = llama3_items(**{**LLAMA3_8B, "n_layers": 2})
    assert set(compute_balanced_assignment(items, 1).values()) == {0}
    with pytest.raises(ValueError):
        compute_balanced_assignment(items, 0)
    with pytest.raises(ValueError):
        compute_balanced_assignment(items + [items[0]], 4)
    assert compute_balanced_assignment([], 4) == {}


# ----------------------------------------------------------------------------------------------------------
# determinism


@pytest.mark.parametrize("flavor,slots", [(LLAMA3_8B, 8), (LLAMA3_8B, 64), (LLAMA3_70B, 64)])
def test_deterministic_and_order_independent(flavor, slots):
    items = llama3_items(**flavor)
    base = compute_balanced_assignment(items, slots)
    assert set(base) == {it.name for it in items}
    assert all(0 <= s < slots for s in base.values())
    assert compute_balanced_assignment(items, slots) == base
    rng = random.Random(1234)
    for _ in range(3):
        shuffled = list(items)
        rng.shuffle(shuffled)
        assert compute_balanced_assignment(shuffled, slots) == base
    assert compute_balanced_assignment(list(reversed(items)), slots) == base


def test_matches_reference_lpt_on_random_inputs():
    rng = random.Random(7)
    for trial in range(20):
        items = []
        for i in range(rng.randint(1, 40)):
            shape = (rng.randint(1, 60), rng.randint(1, 60))
            items.append(PartitionItem(f"p{i:02d}", shape, f"L{rng.randint(0, 5)}"))
        slots = rng.randint(1, 9)
        thr = rng.choice([1, 400, 1500])
        got = compute_balanced_assignment(items, slots, ns_steps=3, small_param_threshold=thr)
        assert got == reference_lpt(items, slots, ns_steps=3, threshold=thr), trial
        shuffled = list(items)
        rng.shuffle(shuffled)
        assert compute_balanced_assignment(shuffled, slots, ns_steps=3, small_param_threshold=thr) == got


# ----------------------------------------------------------------------------------------------------------
# slot_loads


def test_slot_loads_sums():
    items = [PartitionItem("a", (2, 3), "L"), PartitionItem("b", (4, 4), "L"), PartitionItem("c", (5, 1), "M")]
    assignment = {"a": 1, "b": 1, "c": 0}
    # ns_cost: a: 5*4*(6+2)=160, b: 5*16*(8+4)=960, c: 5*1*(10+1)=55
    assert slot_loads(items, assignment, 3) == [55.0, 1120.0, 0.0]
    assert slot_loads(items, assignment, 3, ns_steps=1) == [11.0, 224.0, 0.0]
    items8b = llama3_items(**LLAMA3_8B)
    got = compute_balanced_assignment(items8b, 8)
    loads = slot_loads(items8b, got, 8)
    assert sum(loads) == pytest.approx(sum(ns_cost(it.shape) for it in items8b), rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# balance on Llama-3 shapes


def _balance(flavor, slots):
    items = llama3_items(**flavor)
    got = compute_balanced_assignment(items, slots)
    loads = slot_loads(items, got, slots)
    mean = sum(loads) / slots
    return items, got, loads, mean


@pytest.mark.parametrize(
    "flavor,slots", [(LLAMA3_8B, 8), (LLAMA3_70B, 8), (LLAMA3_70B, 64)], ids=["8B-8", "70B-8", "70B-64"]
)
def test_llama3_balance(flavor, slots):
    items, got, loads, mean = _balance(flavor, slots)
    assert len(items) == 7 * flavor["n_layers"]
    assert max(loads) / mean <= 1.05, (max(loads) / mean, loads)
    # every slot gets work
    assert min(loads) > 0
    # LPT is also within 5% of the certified lower bound (which is the mean here)
    assert max(loads) <= 1.05 * lower_bound(items, slots)


def test_llama3_8b_on_64_slots_within_one_percent_of_lower_bound():
    items, got, loads, mean = _balance(LLAMA3_8B, 64)
    u = 4096**3 * 5  # ns_cost unit for this flavor
    ffn_cost = ns_cost((14336, 4096))
    assert ffn_cost == 8 * u
    # per layer: wq, wo = 3u each, three FFN = 8u each, wk/wv = 0.140625u each -> 30.28125u; 32 layers
    assert sum(loads) == pytest.approx(32 * 30.28125 * u, rel=1e-12)
    # 96 FFN matrices ~0.528 of the mean each: 1.05 x mean is out of reach for any assignment
    assert ffn_cost / mean == pytest.approx(8 / (32 * 30.28125 / 64), rel=1e-12)
    lb = lower_bound(items, 64)
    # the pigeonhole term dominates: the 64th and 65th largest items are both FFN matrices -> 16u
    assert lb == 2 * ffn_cost
    assert lb > 1.05 * mean
    assert max(loads) <= 1.01 * lb, (max(loads) / lb, max(loads) / mean)
