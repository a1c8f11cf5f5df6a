"""DMuon with tensor parallelism (docs/dmuon.md, Tensor parallelism) on real gloo ranks: dp × tp, replicate ×
shard × tp and DDP + TP match single-process torch.optim.Muon + AdamW (losses, weights, global grad norms and
the owners' momentum buffers, TP shards assembled); TP size 1 is bitwise the plain 1D run."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.dmuon_harness import merge_momentum
from tests.dmuon_tp_harness import FF, LAYERS, STEPS, D, tp_reference, tp_train
from tests.reference import assert_rel_close


def _check_parity(results, dp_size, gram_matrices=()):
    ref_losses, ref_sd, ref_norms, ref_momentum = tp_reference(dp_size, gram_matrices)
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


# tp_distributed_gram_policy on the harness's TinyLlama (D = 32, FF = 4 D, "muon" coefficients: 3 Gram all-reduces
# per NS): which of a block's matrices take the distributed Gram. gate/up (FF x D, column-parallel) and down (D x FF,
# row-parallel) are split on their long side, l/s = 4 > 3: the Gram pays. o (square, row-parallel) could take it
# (its Gram splits dim 1) but l/s = 1 <= 3; q/k/v (square, column-parallel: dim 0 split) cannot.
GRAM_OF_POLICY = {
    "beneficial": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "always": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj"),
    "never": (),
}
MATRICES = {  # a block's TP matrices and their full shapes
    **{f"self_attn.{n}_proj": (D, D) for n in "qkvo"},
    "mlp.gate_proj": (FF, D),
    "mlp.up_proj": (FF, D),
    "mlp.down_proj": (D, FF),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(GRAM_OF_POLICY))
def test_tp_distributed_gram_policy_matches_its_reference_and_moves_what_it_decides(policy):
    """tp_distributed_gram=True under each tp_distributed_gram_policy, dp2 x tp2 on 4 gloo ranks: the matrices the
    policy gives the Gram all-reduce s×s Gram matrices (one per restart segment) and match a Gram-formulation
    reference; every other TP matrix is gathered, orthogonalized whole and scattered, and matches the direct one. The
    paths the optimizer reports (dmuon.tp_paths, the start-up log's) and the ledger both show the decision, so a wrong
    one fails here even where the two formulations agree to the parity tolerance."""
    results = run_distributed(tp_train, 4, "dp_tp", (2, 2), tp_distributed_gram=True, tp_distributed_gram_policy=policy)
    gram = {f"layers.{i}.{name}.weight" for i in range(LAYERS) for name in GRAM_OF_POLICY[policy]}
    every = {f"layers.{i}.{name}.weight" for i in range(LAYERS) for name in MATRICES}
    for r in results:
        assert r["tp_paths"] == {fqn: "gram" if fqn in gram else "gather" for fqn in every}
    _check_parity(results, 2, gram)
    # the "muon" triple 5 times restarts before steps 2 and 4 (a product of a = 3.4445 over a third step, 40.9,
    # passes the restart gain 40): 3 all-reduces of s×s per Gram matrix, s² counted on each of its 2 TP ranks
    segments, s = 3, D
    grams = len(GRAM_OF_POLICY[policy]) * LAYERS
    assert sum(r["ledger"].get("tp_gram", 0) for r in results) == pytest.approx(grams * 2 * s * s * segments)
    # a gathered matrix: (T-1)/T of it onto the TP owner on each of its DP owner's 2 TP ranks, as much scattered back
    gathered = LAYERS * sum(m * n for name, (m, n) in MATRICES.items() if name not in GRAM_OF_POLICY[policy])
    for kind in ("tp_gather", "tp_scatter"):
        assert sum(r["ledger"].get(kind, 0) for r in results) == pytest.approx(gathered), kind
