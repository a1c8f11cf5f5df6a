"""dmuon.costs, the cost model, against numbers counted independently: collectives' per-rank shares and a step's
ledger kinds worked out by hand for known shapes and degrees (docs/dmuon.md, "Bytes per step"), Newton-Schulz FLOPs
counted by torch's FlopCounterMode on the real iteration (whole matrices, head blocks, expert stacks), and the TP
path rules on the shapes of a per-head run. tests/distributed/test_dmuon_costs.py holds the communication figures
to a real run's ledger; tests/distributed/test_planner.py holds the planner (which sums them) to real runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_dmuon import dmuon

costs = dmuon.costs


def test_the_public_names() -> None:
    assert costs is dmuon.costs and "costs" in dmuon.__all__
    assert {"gram_restarts", "resolve_coefficients"} <= set(dmuon.__all__)
    # one statement of each formula: the partitioner's and NS module's names are the cost model's
    assert dmuon.partition.ns_cost is costs.ns_cost and dmuon.partition.block_shape is costs.block_shape
    from titan_dmuon.dmuon.newton_schulz import ns_flops

    assert ns_flops is costs.ns_flops


@pytest.mark.parametrize(
    "numel,group,factor,want",
    [(1000, 4, 1, 750.0), (1000, 4, 2, 1500.0), (1000, 1, 1, 0.0), (1000, 1, 2, 0.0), (10, 5, 1, 8.0)],
)
def test_collective_elements(numel, group, factor, want) -> None:
    """(k-1)/k of the tensor per rank (a ring or pipelined tree), twice for an all-reduce, nothing on one rank."""
    assert costs.collective_elements(numel, group, factor) == want


def test_shard_axis_z2_z3_and_the_has_grad_flags() -> None:
    # a 64 x 32 matrix (2048 elements) owned over 4 shard ranks: each rank sends/receives 3/4 of it per collective
    z2 = costs.shard_axis(2048, 4, z3=False)
    assert (z2.broadcast, z2.reduce) == (1536.0, 0.75 * 2049)  # the reduce carries one has-grad flag
    z3 = costs.shard_axis(2048, 4, z3=True)
    assert (z3.broadcast, z3.reduce) == (3072.0, 0.75 * 2049)  # broadcast again before backward
    # docs: Z2 2(N-1)/N P_M, Z3 3(N-1)/N P_M (+ the flags): three matrices of 2048, 1024, 512 elements
    total = costs.shard_axis(3584, 4, z3=True, matrices=3)
    assert total.broadcast + total.reduce == 3 * 0.75 * 3584 + 0.75 * 3
    by_matrix = [costs.shard_axis(n, 4, z3=True) for n in (2048, 1024, 512)]
    assert sum(by_matrix, costs.Traffic()) == total  # linear: a rank's figure is the sum of its matrices'
    assert costs.shard_axis(2048, 1, z3=True) == costs.Traffic()  # a shard group of one rank moves nothing
    assert set(z3.as_dict()) == set(costs.KINDS) and z3.total == 3072 + 0.75 * 2049


def test_replicate_axis_is_the_column_reduce_and_publish() -> None:
    # HSDP R = 4: the owner column's 4 replicas reduce the matrix (+ its flag) onto the owner and get it back
    t = costs.replicate_axis(1000, 4)
    assert (t.replicate_reduce, t.replicate_broadcast) == (0.75 * 1001, 750.0)
    assert t.broadcast == t.reduce == 0
    assert costs.replicate_axis(1000, 1) == costs.Traffic()


def test_tp_gather_scatter_and_distributed_gram() -> None:
    # a 256 x 1024 matrix, TP 4: 3/4 of the full matrix gathered onto the TP owner and as much scattered back
    t = costs.tp_update(256 * 1024, 4)
    assert t.tp_gather == t.tp_scatter == 0.75 * 262144
    # the distributed Gram: one 256 x 256 all-reduce (2 (T-1)/T of it per rank) per restart segment
    assert costs.tp_gram(256, 4, ()).tp_gram == 2 * 0.75 * 65536
    muon = dmuon.gram_restarts(dmuon.resolve_coefficients("muon", 5))
    assert muon == (2, 4)  # newton_schulz.gram_restarts' documented restarts: three segments
    assert costs.tp_gram(256, 4, muon).tp_gram == 3 * 2 * 0.75 * 65536


def test_bytes_each_kind_in_what_it_moves() -> None:
    """Packed params in the param dtype, packed grads in the reduce dtype, the rest (publish, TP) in fp32."""
    e = costs.Traffic(1, 1, 1, 1, 1, 1, 1).bytes(torch.bfloat16, torch.float32)
    assert e.as_dict() == {
        "broadcast": 2,
        "reduce": 4,
        "replicate_reduce": 4,
        "replicate_broadcast": 4,
        "tp_gather": 4,
        "tp_scatter": 4,
        "tp_gram": 4,
    }
    assert costs.Traffic(broadcast=10, reduce=10).bytes(2, 2).as_dict() == {
        **dict.fromkeys(costs.KINDS, 0),
        **{
            "broadcast": 20,
            "reduce": 20,
        },
    }


def _counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _ns(x: torch.Tensor, steps: int) -> torch.Tensor:
    return dmuon.zeropower_via_newtonschulz(x, ns_steps=steps, coefficients="muon", dtype=torch.float32)


@pytest.mark.parametrize("shape,steps", [((24, 40), 5), ((40, 24), 3), ((16, 16), 2)])
def test_ns_flops_and_cost_are_the_counted_matmul_flops(shape, steps) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    counted = _counted_flops(lambda: _ns(g, steps))
    assert costs.ns_flops(shape, steps) == counted
    assert costs.ns_cost(shape, steps) == counted / 2  # the partitioner's unit: half the FLOPs
    assert costs.matrix_ns_flops(shape, None, steps) == counted


@pytest.mark.parametrize("head_blocks", [(0, 8), (1, 8)])
def test_per_head_flops_are_the_blocks_counted_one_by_one(head_blocks) -> None:
    """Per-head Muon on a 32 x 48 matrix in blocks of 8 rows (or columns): NS of each block, counted."""
    dim, size = head_blocks
    g = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    counted = _counted_flops(lambda: [_ns(b, 5) for b in g.split(size, dim=dim)])
    assert costs.num_blocks((32, 48), head_blocks) == (32 if dim == 0 else 48) // 8
    assert costs.block_shape((32, 48), head_blocks) == ((8, 48) if dim == 0 else (32, 8))
    assert costs.matrix_ns_flops((32, 48), head_blocks) == counted
    assert costs.matrix_ns_cost((32, 48), head_blocks) == counted / 2


def test_an_expert_stack_costs_its_experts_batched_ns() -> None:
    """An expert stack (experts x out x in) is orthogonalized expert by expert (EXPERT_BLOCKS), batched: its
    FLOPs are those torch counts for the batched call on the stack."""
    stack = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(2))
    counted = _counted_flops(lambda: _ns(stack, 5))
    assert costs.update_blocks(stack.shape, None) == costs.EXPERT_BLOCKS == (0, 1)
    assert costs.matrix_ns_flops(tuple(stack.shape)) == counted == 4 * costs.ns_flops((24, 16), 5)
    assert costs.update_blocks((24, 16), (0, 8)) == (0, 8) and costs.update_blocks((24, 16), None) is None


PE = (2,)  # Polar Express, 5 steps: one restart, two Gram all-reduces per NS
MUON = (2, 4)  # "muon", 5 steps: three


@pytest.mark.parametrize(
    "full,local,shard_dim,blocks,gram,path",
    [
        ((64, 64), (64, 64), None, None, True, "local"),  # not TP-sharded
        ((64, 64), (32, 64), 0, (0, 16), False, "local"),  # wq by whole heads (2 heads of 16 rows per shard)
        ((64, 64), (64, 32), 1, (1, 16), False, "local"),  # wo by whole head columns
        ((64, 64), (32, 64), 0, (0, 24), False, "gather"),  # 32 rows per shard do not hold whole 24-row heads
        ((64, 64), (64, 32), 1, (0, 16), False, "gather"),  # heads along the other dim: a head spans the shards
        ((192, 64), (96, 64), 0, None, True, "gram"),  # the long side sharded, l/s = 3 > 2 segments: Gram pays
        ((192, 64), (96, 64), 0, None, False, "gather"),  # ... when asked for
        ((64, 128), (32, 128), 0, None, True, "gather"),  # the short side sharded: gather
        ((64, 64), (32, 64), 0, None, True, "gather"),  # square: Gram's payload no smaller
        ((128, 64), (64, 64), 0, (0, 16), True, "local"),  # per-head with whole heads beats the Gram
        ((8, 16, 32), (4, 16, 32), 0, costs.EXPERT_BLOCKS, False, "local"),  # an expert stack's EP shard
    ],
)
def test_tp_path(full, local, shard_dim, blocks, gram, path) -> None:
    assert costs.tp_path(full, local, shard_dim, blocks, distributed_gram=gram, restarts=PE) == path


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(
    "full,shard_dim,restarts,beneficial",
    [
        ((14336, 4096), 0, PE, True),  # Llama-3 8B w1/w3 (column-parallel): l/s = 3.5 > 2 segments
        ((4096, 14336), 1, PE, True),  # w2 (row-parallel)
        ((14336, 4096), 0, MUON, True),  # 3.5 > 3 segments
        ((4096, 4096), 1, PE, False),  # wo (row-parallel, square): 2 s² of Gram against s² gathered
        ((256, 512), 1, PE, False),  # l/s = 2 = 2 segments: a tie keeps the gather
        ((256, 768), 1, PE, True),  # l/s = 3 > 2
        ((256, 768), 1, MUON, False),  # 3 = 3 segments
        ((256, 1024), 1, MUON, True),  # 4 > 3
        ((1024, 256), 0, (), True),  # no restart, l/s = 4 > 1
    ],
)
def test_beneficial_is_the_smaller_payload(full, shard_dim, restarts, beneficial, tp) -> None:
    """ "beneficial" takes the Gram where its all-reduces (`tp_gram`: one s×s fp32 all-reduce per restart segment,
    2(T-1)/T of it per rank) move fewer bytes than gathering and scattering the full update (`tp_update`: (T-1)/T of
    m×n each), the formula: (1 + restarts)·2(T-1)/T·s²·4 < 2(T-1)/T·m·n·4, i.e. l > (1 + restarts)·s at any T;
    "always" takes it there too, "never" never; the decision carries both byte counts."""
    local = list(full)
    local[shard_dim] //= tp
    s, long = sorted(full)
    f = (tp - 1) / tp
    gram_bytes, gather_bytes = (1 + len(restarts)) * 2 * f * s * s * 4, 2 * f * s * long * 4
    assert costs.gram_is_beneficial(full, tp, restarts) is beneficial is (gram_bytes < gather_bytes)
    for policy, path in (("beneficial", "gram" if beneficial else "gather"), ("always", "gram"), ("never", "gather")):
        d = costs.tp_decision(full, local, shard_dim, None, distributed_gram=True, policy=policy, restarts=restarts)
        assert d.path == path, (policy, d)
        if policy != "never":
            assert d.gram_bytes == pytest.approx(gram_bytes) and d.gather_bytes == pytest.approx(gather_bytes)
        off = costs.tp_decision(full, local, shard_dim, None, distributed_gram=False, policy=policy, restarts=restarts)
        assert off.path == "gather"  # tp_distributed_gram off: the policy is not consulted


@pytest.mark.parametrize(
    "full,local,shard_dim,blocks,why",
    [
        ((1024, 4096), (512, 4096), 0, None, "short side"),  # Llama-3 8B wk/wv (column-parallel): dim 0 is short
        ((4096, 4096), (2048, 4096), 0, None, "square"),  # wq: a square matrix's Gram path splits dim 1
        ((256, 1024), (256, 512), 1, (1, 100), "blocks"),  # per-head blocks that straddle the shards
    ],
)
def test_always_falls_back_to_the_gather_where_the_gram_cannot_run(full, local, shard_dim, blocks, why) -> None:
    """ "always" takes the Gram wherever the identity X Xᵀ = Σ X_i X_iᵀ holds (the whole matrix, TP-split on its long
    side; a square one on dim 1, which NS iterates along); elsewhere it keeps the gather (a Llama has such matrices
    in every block: refusing them would make "always" unusable) and says why."""
    d = costs.tp_decision(full, local, shard_dim, blocks, distributed_gram=True, policy="always", restarts=PE)
    assert d.path == "gather" and why in d.reason, d
    assert costs.gram_split_dim((4096, 4096)) == 1 and costs.gram_split_dim((14336, 4096)) == 0
    square_rowwise = costs.tp_decision((64, 64), (64, 32), 1, None, distributed_gram=True, policy="always", restarts=PE)
    assert square_rowwise.path == "gram"  # wo: possible, though not beneficial
    beneficial = costs.tp_decision((64, 64), (64, 32), 1, None, distributed_gram=True, restarts=PE)
    assert beneficial.path == "gather" and "l/s = 1" in beneficial.reason


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    assert costs.TP_GRAM_POLICIES == ("beneficial", "always", "never")
    with pytest.raises(
        ValueError,
        match=r"tp_distributed_gram_policy must be one of 'beneficial', 'always', 'never', "
        r"got 'sometimes'",
    ):
        costs.tp_decision((128, 64), (64, 64), 0, None, distributed_gram=True, policy="sometimes", restarts=PE)
    with pytest.raises(ValueError, match="needs the Gram restarts"):  # "beneficial" cannot count the Gram's bytes
        costs.tp_path((128, 64), (64, 64), 0, None, distributed_gram=True)
    assert costs.tp_path((128, 64), (64, 64), 0, None, distributed_gram=True, policy="always") == "gram"
    assert costs.tp_path((128, 64), (64, 64), 0, None, distributed_gram=False) == "gather"


def test_matrices_reads_the_live_layout(one_rank) -> None:
    """dmuon.dedicated_matrices gives the dedicated matrices as dedicate_params placed them: in group order, with their
    shapes, owners, groups, the dtypes their buffers move in and (per-head Muon on) their head blocks."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tiny_models import TinyLlama, proj_predicate

    model = TinyLlama(32, 64, 4, 2)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert dmuon.dedicated_matrices(model) == []  # before dedicate_params
    q = "layers.0.self_attn.q_proj.weight"
    dmuon.dedicate_params(model, mesh, proj_predicate, param_dtype=torch.bfloat16, head_blocks={q: (0, 8)})
    dps = dmuon.get_dedicated_params(model)
    got = dmuon.dedicated_matrices(model)
    assert [m.fqn for m in got] == [dp.fqn for dp in dps] and len(got) == 14
    for m, dp in zip(got, dps, strict=True):
        assert m.full_shape == m.local_shape == tuple(dp.param.shape) and m.numel == dp.param.numel()
        assert (m.owner_shard, m.owner_replicate, m.shard_dim, m.tp_size) == (0, 0, None, 1)
        assert (m.param_itemsize, m.reduce_itemsize) == (2, 4) and not m.expert and m.head_blocks is None
        assert m.group == dp.group.index and m.hook == dp.group.module_fqn
        assert m.ns_cost() == costs.ns_cost(m.full_shape) and m.tp_path() == "local"
    per_head = {m.fqn: m for m in dmuon.dedicated_matrices(model, dmuon.MuonOptions(per_head=True))}
    assert per_head[q].head_blocks == (0, 8) and per_head[q].ns_cost() == 4 * costs.ns_cost((8, 32))
    assert all(m.head_blocks is None for f, m in per_head.items() if f != q)
