"""DMuon with tensor parallelism (docs/dmuon.md, Tensor parallelism) on real gloo ranks: dp × tp, replicate ×
shard × tp and DDP + TP match single-process torch.optim.Muon + AdamW (losses, weights, global grad norms and
the owners' momentum buffers, TP shards assembled); TP size 1 is bitwise the plain 1D run."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.dmuon_harness import merge_momentum
from tests.dmuon_tp_harness import LAYERS, STEPS, D, tp_reference, tp_train
from tests.reference import assert_rel_close


def _check_parity(results, dp_size, gram_for_rectangular: bool = False):
    ref_losses, ref_sd, ref_norms, ref_momentum = tp_reference(dp_size, gram_for_rectangular)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        for k, v in ref_sd.items():  # full (unsharded across TP) tensors from the getters
            assert r["sd"][k].shape == v.shape, k
            assert_rel_close(r["sd"][k], v, 1e-5, k)
    for step in range(STEPS):  # the DP owners' momentum shards, assembled across TP ranks
        got = merge_momentum([r["momentum"][step] for r in results])
        assert set(got) == set(ref_momentum[step]), step
        for k, v in ref_momentum[step].items():
            assert_rel_close(got[k], v, 1e-5, f"step {step} momentum {k}")
    for k, v in ref_momentum[-1].items():  # and through the checkpoint getter (TP all-gather)
        assert_rel_close(results[0]["osd"]["state"][k]["momentum_buffer"], v, 1e-5, k)
    for step in range(STEPS):  # one NS per matrix per step across all ranks
        assert sum(r["ns_calls"][step] for r in results) == results[0]["n_dedicated"]


@pytest.mark.slow
def test_dp2_tp2_parity_async_equals_sync_and_tp_owners_spread():
    asyn = run_distributed(tp_train, 4, "dp_tp", (2, 2), replicate_async=True, tp_buffer_reuse="all")
    sync = run_distributed(tp_train, 4, "dp_tp", (2, 2), replicate_async=False)
    _check_parity(asyn, 2)
    for a, s in zip(asyn, sync, strict=True):
        assert a["losses"] == s["losses"]
        assert all(torch.equal(a["sd"][k], s["sd"][k]) for k in a["sd"])
        for fqn, st in a["osd"]["state"].items():
            for name, t in st.items():
                assert torch.equal(torch.as_tensor(t), torch.as_tensor(s["osd"]["state"][fqn][name])), (fqn, name)
    tp_owner_ranks = {r["tp_rank"] for r in asyn for o in r["owned"] if o["is_tp_owner"]}
    assert len(tp_owner_ranks) >= 2  # NS work spread over the TP ranks
    for r in asyn:
        for o in r["owned"]:
            assert o["tp_group_size"] == 2 and o["shard_dim"] in (0, 1)
            assert o["full"][o["shard_dim"]] == 2 * o["local"][o["shard_dim"]]
        assert r["ledger"]["tp_gather"] > 0 or not any(o["is_tp_owner"] for o in r["owned"])


@pytest.mark.slow
def test_replicate2_shard2_tp2_parity():
    _check_parity(run_distributed(tp_train, 8, "3d", (2, 2, 2)), 4)


@pytest.mark.slow
def test_ddp_tp_parity():
    results = run_distributed(tp_train, 4, "ddp_tp", (2, 2))
    _check_parity(results, 2)


@pytest.mark.slow
def test_tp_size_1_is_bitwise_the_plain_run():
    tp1 = run_distributed(tp_train, 4, "dp_tp", (4, 1))
    plain = run_distributed(tp_train, 4, "plain", (4,))
    for a, b in zip(tp1, plain, strict=True):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["sd"][k], b["sd"][k]) for k in a["sd"])


@pytest.mark.slow
def test_tp_distributed_gram_matches_gram_reference_and_skips_gather():
    """tp_distributed_gram: non-square TP matrices sharded on their long side (gate/up/down) all-reduce an
    s×s Gram instead of gathering/scattering the m×n update; square ones keep gather -> NS -> scatter."""
    results = run_distributed(tp_train, 4, "dp_tp", (2, 2), tp_distributed_gram=True)
    _check_parity(results, 2, gram_for_rectangular=True)
    s = D  # short side of gate/up/down: Gram all-reduce of s×s per matrix on each DP-owner TP rank
    # per restart segment: the "muon" triple 5 times restarts before steps 2 and 4 (a product of a = 3.4445 over a
    # third step, 40.9, passes the restart gain 40), so 3 all-reduces per matrix
    segments = 3
    for r in results:
        grams = r["ledger"]["tp_gram"]
        assert grams == 0 or grams % (s * s) == 0
    assert sum(r["ledger"]["tp_gram"] for r in results) == pytest.approx(3 * LAYERS * 2 * s * s * segments)
