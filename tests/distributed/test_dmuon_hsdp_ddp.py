"""DMuon on HSDP (replicate × shard) and DDP (dmuon.replicate or torch's DistributedDataParallel), real gloo
ranks: parity with torch.optim.Muon + AdamW (losses, weights, global grad norms, momentum buffers) and with the
1D run, sync vs async publish bitwise, invariants I1-I4, the HSDP and DDP bytes (docs/dmuon.md, Bytes per
step), and grad accumulation under each no_sync a torch DDP user may write."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.dmuon_harness import assert_matches_reference, reference, train
from tests.reference import assert_rel_close

STEPS = 8


@pytest.mark.slow
def test_hsdp_2x2_parity_async_equals_sync_and_matches_1d():
    asyn = run_distributed(train, 4, "hsdp", (2, 2), STEPS, replicate_async=True)
    sync = run_distributed(train, 4, "hsdp", (2, 2), STEPS, replicate_async=False)
    flat = run_distributed(train, 4, "fsdp", (4,), STEPS)
    assert_matches_reference(asyn, reference(4, STEPS))
    for a, s in zip(asyn, sync, strict=True):  # async only moves the wait: bitwise the same run
        assert a["losses"] == s["losses"] and a["norms"] == s["norms"]
        assert all(torch.equal(a["sd"][k], s["sd"][k]) for k in a["sd"])
        for fqn, st in a["osd"]["state"].items():
            for name, t in st.items():
                assert torch.equal(torch.as_tensor(t), torch.as_tensor(s["osd"]["state"][fqn][name])), (fqn, name)
    for k, v in flat[0]["sd"].items():  # HSDP (2, 2) equals 1D (4,) up to the two-stage average's rounding
        assert_rel_close(asyn[0]["sd"][k], v, 1e-5, k)
    # owners spread over both axes: all 4 (shard, replicate) slots own something
    assert sum(1 for r in asyn if r["owned"]) == 4
    for step in range(STEPS):
        assert sum(r["ns_calls"][step] for r in asyn) == asyn[0]["n_dedicated"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 1), (1, 4)], ids=["2x2", "2x1", "1x4"])
@pytest.mark.parametrize("z3", [False, True], ids=["Z2", "Z3"])
def test_hsdp_bytes_match_formula_and_parity(mesh_shape, z3):
    """The HSDP bytes (docs/dmuon.md, Bytes per step) per step: shard reduce (N-1)/N·P_M and shard broadcast
    (N-1)/N·P_M (twice under Z3) on every rank; the replicate reduce and publish carry (R-1)/R of each
    column's params, so per rank (R-1)/R·P_col and, summed over the N ranks of a replicate row, exactly
    (R-1)/R·P_M. And the same short runs match the reference (a replicate-only 2x1 mesh included)."""
    R, N = mesh_shape
    results = run_distributed(train, R * N, "hsdp", mesh_shape, 3, z3=z3, check_every_step=True)
    assert_matches_reference(results, reference(R * N, 3))
    # the reduces also carry one has-grad flag per matrix: M in all, M_col in a column
    p_m, m = results[0]["p_m"], results[0]["n_dedicated"]
    for r in results:
        for led in r["ledgers"]:
            assert led["reduce"] == pytest.approx((N - 1) / N * (p_m + m), rel=1e-12)
            assert led["broadcast"] == pytest.approx((2 if z3 else 1) * (N - 1) / N * p_m, rel=1e-12)
            assert led["replicate_reduce"] == pytest.approx((R - 1) / R * (r["p_col"] + r["m_col"]), rel=1e-12)
            assert led["replicate_broadcast"] == pytest.approx((R - 1) / R * r["p_col"], rel=1e-12)
    for row in range(R):
        members = [r for r in results if r["coord"][1] == row]
        assert len(members) == N
        for kind, flags in (("replicate_reduce", m), ("replicate_broadcast", 0)):
            total = sum(mem["ledgers"][-1][kind] for mem in members)
            assert total == pytest.approx((R - 1) / R * (p_m + flags), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", ["ddp", "torch_ddp"])
def test_ddp_parity_and_identical_params(layout, world_size):
    """dedicate_params_ddp with dmuon.replicate, or with torch's DistributedDataParallel wrapping the model
    (which leaves the dedicated params to DMuon); the DDP-wrapped model goes to dmuon.Muon, clip_grad_norm_
    and the state-dict getters as it is (keys without `module.`)."""
    results = run_distributed(train, world_size, layout, (world_size,), STEPS)
    assert_matches_reference(results, reference(world_size, STEPS))
    for r in results[1:]:
        assert all(torch.equal(r["sd"][k], results[0]["sd"][k]) for k in r["sd"])
    # the DDP bytes (docs/dmuon.md, Bytes per step): reduce to the owner + broadcast from it, each
    # (N-1)/N·P_M per rank
    p_m = results[0]["p_m"]
    for r in results:
        for led in r["ledgers"]:
            flags = results[0]["n_dedicated"]  # the reduce's has-grad flag per matrix
            assert led["replicate_reduce"] == pytest.approx((world_size - 1) / world_size * (p_m + flags), rel=1e-12)
            assert led["replicate_broadcast"] == pytest.approx((world_size - 1) / world_size * p_m, rel=1e-12)
            assert led["broadcast"] == led["reduce"] == 0
    for step in range(STEPS):
        assert sum(r["ns_calls"][step] for r in results) == results[0]["n_dedicated"]


@pytest.mark.slow
def test_torch_ddp_grad_accumulation_under_each_no_sync():
    """Two micro-batches per step under torch DDP; step by step the first runs with no no_sync, inside
    `dmuon.no_sync(ddp_model)` (which enters DDP's own), inside DDP's `no_sync()` alone (DMuon still reduces
    every micro-batch), inside both nested, and inside `dmuon.no_sync` of the wrapped module (DDP still
    syncs). Every way gives the reference's step, so whichever a user writes is right."""
    styles = ("none", "dmuon", "torch", "both", "inner")
    results = run_distributed(train, 2, "torch_ddp", (2,), len(styles), micro=2, no_sync=styles)
    assert_matches_reference(results, reference(2, len(styles), micro=2))
    for r in results[1:]:
        assert all(torch.equal(r["sd"][k], results[0]["sd"][k]) for k in r["sd"])


def _double_step(rank: int, world_size: int, replicate_async: bool):
    """Two step() calls with no forward between them (async publishes in flight), then train on."""
    from tests.dmuon_harness import B, D, build, check_i4
    from tests.tiny_models import batch
    from titan_dmuon import dmuon

    model, opt, _ = build("hsdp", (2, 2), replicate_async=replicate_async)
    losses = []
    for step in range(3):
        loss = model(batch(step, rank, B, D))
        loss.backward()
        opt.step()
        opt.step()  # the second step drains the first one's publish before touching `_owned_data`
        opt.zero_grad()
        losses.append(loss.item())
    sd = dmuon.get_model_state_dict(model)  # drains the last publish first
    check_i4(model)
    return losses, sd


@pytest.mark.slow
def test_hsdp_two_steps_without_forward_drain():
    asyn = run_distributed(_double_step, 4, True)
    sync = run_distributed(_double_step, 4, False)
    for (la, sa), (ls, ss) in zip(asyn, sync, strict=True):
        assert la == ls
        assert all(torch.equal(sa[k], ss[k]) for k in sa)
