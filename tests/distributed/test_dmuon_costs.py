"""dmuon.costs against a real run's ledger: a TinyLlama on 4 gloo ranks (HSDP 2 x 2 in Z2 and Z3; dp 2 x tp 2 with
the TP updates gathered, and with the distributed Gram under the "beneficial" and "always" policies), two steps,
then on every rank `dmuon.comm_stats` equals the cost model's figures of the model's own matrices
(`dmuon.dedicated_matrices`), each counted on the ranks it moves on, on the path `costs.tp_path` decides: its shard
group's broadcast and reduce, its owner column's replicate reduce and publish, its DP owner's TP traffic."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytestmark = pytest.mark.slow  # several seconds of multi-rank runs: the full suite, not the quick tier

LAYOUTS = {
    "hsdp2x2-z3": dict(mesh=(2, 2, 1), z3=True, gram=False),
    "hsdp2x2-z2": dict(mesh=(2, 2, 1), z3=False, gram=False),
    "dp2xtp2": dict(mesh=(1, 2, 2), z3=True, gram=False),
    # FF = 4 D: the MLP's l/s = 4 > the 3 Gram all-reduces of "muon": "beneficial" gives it the Gram, q/k/v/o gather
    "dp2xtp2-gram": dict(mesh=(1, 2, 2), z3=True, gram=True, policy="beneficial", ff=128),
    # FF = 2 D: "beneficial" would gather all; "always" gives the MLP and o (square, row-parallel) the Gram
    "dp2xtp2-gram-always": dict(mesh=(1, 2, 2), z3=True, gram=True, policy="always"),
}


def _run(
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, int, int],
    z3: bool,
    gram: bool,
    policy: str = "beneficial",
    ff: int = 64,
) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dmuon_harness import build_muon, shard_blocks
    from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate, seq_batch
    from titan_dmuon import dmuon

    torch.manual_seed(0)
    model = TinyLlama(32, ff, 4, 2)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard", "tp"))
    if mesh_shape[2] > 1:
        apply_llama_tp(model, mesh["tp"])
    replicate = mesh["replicate"] if mesh_shape[0] > 1 else None
    dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=replicate, reshard_after_forward=z3)
    shard_blocks(model, mesh["replicate", "shard"] if replicate is not None else mesh["shard"])
    opt = build_muon(model, tp_distributed_gram=gram, tp_distributed_gram_policy=policy)
    coord = mesh.get_coordinate()
    for step in range(2):  # the second step is a steady one (an async TP scatter lands in the step after its own)
        model(seq_batch(step, coord[0] * mesh_shape[1] + coord[1], 2, 8, 32)).backward()
        opt.step()
        opt.zero_grad()
    dmuon.drain(model)
    dp = dmuon.get_dedicated_params(model)[0]
    muon = next(g for g in opt.param_groups if g["kind"] == "muon")
    return {
        "ledger": dmuon.comm_stats(model),
        "coord": {"replicate": dp.replicate_rank, "shard": dp.shard_rank},
        "restarts": dmuon.gram_restarts(dmuon.resolve_coefficients(muon["ns_coefficients"], muon["ns_steps"])),
        "matrices": dmuon.dedicated_matrices(model),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cost_model_is_the_ledger_of_a_real_run(layout) -> None:
    from titan_dmuon import dmuon

    costs = dmuon.costs
    spec = LAYOUTS[layout]
    R, N, _ = spec["mesh"]
    policy, ff = spec.get("policy", "beneficial"), spec.get("ff", 64)
    results = run_distributed(_run, 4, spec["mesh"], spec["z3"], spec["gram"], policy, ff)
    paths = set()
    for rank, got in enumerate(results):
        want = costs.Traffic()
        wire = costs.Traffic()
        for m in got["matrices"]:
            column = got["coord"]["shard"] == m.owner_shard
            owner = column and got["coord"]["replicate"] == m.owner_replicate
            path = m.tp_path(spec["gram"], policy, got["restarts"])
            paths.add(path)
            mine = costs.shard_axis(m.numel, N, z3=spec["z3"])  # every rank of the shard group
            if column:
                mine = mine + costs.replicate_axis(m.numel, R)
            if owner and path == "gather":
                mine = mine + costs.tp_update(m.numel * m.tp_size, m.tp_size)
            if owner and path == "gram":
                mine = mine + costs.tp_gram(min(m.full_shape), m.tp_size, got["restarts"])
            want = want + mine
            wire = wire + mine.bytes(m.param_itemsize, m.reduce_itemsize)
        for kind in costs.KINDS:
            assert got["ledger"]["elements"][kind] == pytest.approx(getattr(want, kind), rel=1e-12), (rank, kind)
            assert got["ledger"]["bytes"][kind] == pytest.approx(getattr(wire, kind), rel=1e-12), (rank, kind)
    moved = {k for got in results for k, v in got["ledger"]["elements"].items() if v > 0}
    if R > 1:
        assert moved == {"broadcast", "reduce", "replicate_reduce", "replicate_broadcast"}, moved
    else:  # the TP layouts: q/k/v/o square (gathered), the MLP's long side sharded (the Gram when asked for)
        assert paths == ({"gather", "gram"} if spec["gram"] else {"gather"}), paths
        assert moved == {"broadcast", "reduce", "tp_gather", "tp_scatter"} | ({"tp_gram"} if spec["gram"] else set())
