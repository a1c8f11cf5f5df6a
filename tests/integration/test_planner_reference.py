"""The dry-run planner's totals (titan_dmuon/planner/) against bytes counted here by hand from the model.

tests/distributed/test_planner.py holds the planner's five resident kinds and its ledger kinds to a real run;
the totals built from them (resident total, peak, DMuon's total bytes per step, the naive FSDP2 + Muon and
FSDP2 + AdamW totals, the other params' traffic) are only printed. Here `train.py --job.dry_run` plans the
tinymodel on a fake 4-rank world (1D FSDP x 4, and HSDP 2 x 2; and the qwen3 tinymodel_moe with expert
parallelism 2, its own test below), and every rank's totals are checked against numel x element size of the
model's own parameters, counted here:

  resident   FSDP2 shards (dim 0 cut in ceil(n / N) rows, as torch.chunk) of the params Muon does not take, fp32
             + DMuon's fp32 masters of the matrices owned in the rank's shard column + Muon momentum (fp32) of
             those the rank owns globally + AdamW's two moments per FSDP2 element + the gradients (FSDP2 shards
             and the owners' fp32 reduced grads)
  peak       resident + the packed-buffer transient the plan replays + FSDP2's root unit gathered (params and
             grads of everything Muon does not take) + the family's activation estimate
             (titan_dmuon/models/common/memory.py, called here)
  traffic    per rank and step (docs/dmuon.md, "Bytes per step"), P_M = the Muon matrices' elements:
             DMuon Z3 broadcasts 2 (N-1)/N P_M and reduces (N-1)/N P_M; HSDP adds (R-1)/R P_col for the replicate
             reduce and as much for the publish (the reduces may carry one has-grad flag per matrix: M more
             elements, M_col on the replicate axis). Naive FSDP2 + Muon all-gathers the matrices for forward and again
             for backward, reduce-scatters their grads, all-reduces the shards over the replicas and all-gathers every
             grad whole; FSDP2 + AdamW the same without the last. The other params (embeddings, norms, output) are
             FSDP2's root unit: gathered once (not resharded after forward), reduce-scattered, all-reduced.

Only the ownership (which shard column and replica owns each matrix: the LPT plan, tested on its own in
tests/unit/dmuon/test_partition.py) is taken from the plan.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.train_runs import run_train, tail

pytestmark = pytest.mark.slow

WORLD, BATCH, SEQ, E = 4, 2, 32, 4  # fp32 params, grads, reduce, masters
MUON = re.compile(r"^layers\.\d+\.(attention|feed_forward)\.\w+\.weight$")  # the llama3 family's documented default
LAYOUTS = {"fsdp4": (1, 4), "hsdp2x2": (2, 2)}  # (replicate R, shard N)


def _plan(tmp_path, replicate: int) -> dict:
    out = tmp_path / "plan.json"
    argv = ["--config", "train_configs/debug_model.toml", "--model.flavor", "tinymodel"]
    argv += ["--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)]
    argv += ["--parallelism.data_parallel_replicate_degree", str(replicate)]
    argv += ["--job.dry_run", "--job.dry_run_world_size", str(WORLD), "--job.dry_run_json", str(out)]
    proc = run_train(1, argv, timeout=180)
    assert proc.returncode == 0, tail(proc)
    return json.loads(out.read_text())


def _model():
    from titan_dmuon.models.llama3 import build_model

    return build_model("tinymodel", vocab_size=258, device="meta", max_seq_len=SEQ)


def _rows(n: int, shards: int, s: int) -> int:
    """Rows of shard s of n rows cut in `shards` (as torch.chunk: ceil(n / shards) each, the last shorter or empty)."""
    per = -(-n // shards)
    return max(0, min(n, (s + 1) * per) - s * per)


def _expected(replicate: int, shard: int, owners: dict) -> dict:
    """Per rank (row-major over (replicate, shard)): the resident kinds and the traffic, counted by hand."""
    model = _model()
    muon = {n: p.numel() for n, p in model.named_parameters() if MUON.search(n) and p.ndim == 2}
    other = {n: p for n, p in model.named_parameters() if n not in muon}
    assert len(muon) == 14 and set(owners) == set(muon)
    p_m, p_other = sum(muon.values()), sum(p.numel() for p in other.values())
    p_col = [sum(n for f, n in muon.items() if owners[f][0] == s) for s in range(shard)]
    m_col = [sum(1 for f in muon if owners[f][0] == s) for s in range(shard)]
    frac_n, frac_r = (shard - 1) / shard, (replicate - 1) / replicate
    out = {key: [] for key in ("resident", "dmuon_broadcasts", "dmuon_reduces", "other")}
    for g in range(WORLD):
        r, s = divmod(g, shard)
        fsdp = sum(_rows(p.shape[0], shard, s) * math.prod(p.shape[1:]) for p in other.values()) * E
        masters = p_col[s] * E
        momentum = sum(n for f, n in muon.items() if owners[f][:2] == [s, r]) * E
        grads = fsdp + momentum
        out["resident"].append(fsdp + masters + momentum + 2 * fsdp + grads)
        # the broadcasts and the publish; the reduces, without and with one has-grad flag per matrix
        out["dmuon_broadcasts"].append((2 * frac_n * p_m + frac_r * p_col[s]) * E)
        reduces = [
            (frac_n * (p_m + flags * len(muon)) + frac_r * (p_col[s] + flags * m_col[s])) * E for flags in (0, 1)
        ]
        out["dmuon_reduces"].append(reduces)
        out["other"].append((2 * frac_n * p_other + 2 * frac_r * p_other / shard) * E)
    fsdp_adamw = (3 * frac_n * p_m + 2 * frac_r * p_m / shard) * E
    out["fsdp2_adamw"] = fsdp_adamw
    out["p_other"] = p_other
    out["naive"] = fsdp_adamw + (WORLD // replicate - 1) / (WORLD // replicate) * p_m * E
    # a sanity check of the counts themselves: each matrix's momentum once, its master once per replica
    out["momentum_sum"], out["masters_sum"] = p_m * E, p_m * E * replicate
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_totals_equal_the_bytes_counted_from_the_model(tmp_path, layout):
    from titan_dmuon.models.common.memory import activation_estimate

    replicate, shard = LAYOUTS[layout]
    plan = _plan(tmp_path, replicate)
    assert plan["config"]["mesh"] == {"pp": 1, "replicate": replicate, "shard": shard, "tp": 1}
    mem, comm = plan["memory_bytes"], plan["bytes_per_step"]
    want = _expected(replicate, shard, plan["lpt"]["owners"])
    assert sum(mem["muon_momentum"]["per_rank"]) == want["momentum_sum"]
    assert sum(mem["dmuon_fp32_masters"]["per_rank"]) == want["masters_sum"]

    activations = activation_estimate(_model(), batch=BATCH, seq_len=SEQ, dtype_bytes=E, tp=1, ac_mode="none").total
    transient = mem["dmuon_packed_transient_peak"]["per_rank"]
    assert len(set(transient)) == 1 and transient[0] > 0
    flags = []  # per rank, which count of the reduces it matches: without has-grad flags, with them
    for g in range(WORLD):
        resident = mem["resident_total"]["per_rank"][g]
        assert resident == pytest.approx(want["resident"][g], rel=1e-12), (layout, g, "resident total")
        peak = mem["peak_estimate"]["per_rank"][g]
        # FSDP2's root unit (every param Muon does not take: DMuon's blocks are no units) gathered whole, its params
        # and its grads (fp32 both here)
        root = want["p_other"] * 2 * E
        assert mem["fsdp_root_unsharded"]["per_rank"][g] == pytest.approx(root, rel=1e-12), (layout, g, "root")
        want_peak = want["resident"][g] + transient[g] + root + activations
        assert peak == pytest.approx(want_peak, rel=1e-12), (layout, g, "peak")
        reduces = sum(comm["dmuon_bytes"][k]["per_rank"][g] for k in ("reduce", "replicate_reduce"))
        flags.append([i for i, r in enumerate(want["dmuon_reduces"][g]) if r == pytest.approx(reduces, rel=1e-12)])
        assert flags[-1], (layout, g, "DMuon reduce bytes", reduces, want["dmuon_reduces"][g])
        total, counted = comm["dmuon_total_bytes"]["per_rank"][g], want["dmuon_broadcasts"][g] + reduces
        assert total == pytest.approx(counted, rel=1e-12), (layout, g, "DMuon bytes per step")
        other = comm["other_params_fsdp2_bytes"]["per_rank"][g]
        assert other == pytest.approx(want["other"][g], rel=1e-12), (layout, g, "other params' bytes")
    assert len({tuple(f) for f in flags}) == 1, flags  # one rule for every rank
    assert comm["fsdp2_adamw_bytes"]["total"] == pytest.approx(want["fsdp2_adamw"], rel=1e-12)
    assert comm["naive_fsdp2_muon_bytes"]["total"] == pytest.approx(want["naive"], rel=1e-12)


def test_moe_expert_parallel_totals_equal_the_bytes_counted_from_the_model(tmp_path):
    """Qwen3-MoE (tinymodel_moe: 2 blocks, 8 experts of which 2 per token) with EP 2 on FSDP 4: efsdp 2 x ep 2, rank
    g at expert shard g // 2 and EP rank g % 2. Each rank holds 4 of the 8 experts of every stack; DMuon owns the
    stacks over the expert shard groups of G_e = 2 ranks ({0, 2} and {1, 3}), so an owner's master, momentum and
    reduced grad are of its 4 experts. Counted here: the resident bytes of every rank, DMuon's bytes per step, the
    naive FSDP2 + Muon and FSDP2 + AdamW totals (the stacks are FSDP2 units over the expert shard group there, and
    naive Muon all-gathers every grad whole) and the MoE all-to-all (uniform routing)."""
    from titan_dmuon.models.qwen3 import MUON_PARAMS, build_model

    out = tmp_path / "plan.json"
    argv = ["--config", "train_configs/debug_model.toml", "--model.name", "qwen3", "--model.flavor", "tinymodel_moe"]
    argv += ["--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)]
    argv += ["--parallelism.expert_parallel_degree", "2"]
    argv += ["--job.dry_run", "--job.dry_run_world_size", str(WORLD), "--job.dry_run_json", str(out)]
    proc = run_train(1, argv, timeout=180)
    assert proc.returncode == 0, tail(proc)
    plan = json.loads(out.read_text())
    ep, n, g_e = 2, WORLD, WORLD // 2
    assert plan["config"]["expert_parallel"] == {"ep": ep, "efsdp": 2, "expert_shard": g_e}

    model = build_model("tinymodel_moe", vocab_size=258, max_seq_len=SEQ)
    assert sum(p.numel() for p in model.parameters()) == plan["config"]["params"]
    muon = {f: p for f, p in model.named_parameters() if re.search(MUON_PARAMS, f)}
    stacks = {f: p.numel() // ep for f, p in muon.items() if p.ndim == 3}  # each rank's 4 experts of a stack
    dense = {f: p.numel() for f, p in muon.items() if p.ndim == 2}
    other = [p for f, p in model.named_parameters() if f not in muon]
    assert len(stacks) == 6 and len(dense) == 8
    p_m, p_e = sum(dense.values()), sum(stacks.values())
    owners = plan["lpt"]["owners"]  # [shard, replicate, tp owner]: a stack's shard is its expert shard
    assert {owners[f][0] for f in stacks} <= set(range(g_e)) and all(owners[f][2] is None for f in stacks)
    mem, comm = plan["memory_bytes"], plan["bytes_per_step"]
    for g in range(WORLD):
        s, es = g, g // ep
        fsdp = sum(_rows(p.shape[0], n, s) * math.prod(p.shape[1:]) for p in other) * E
        owned = sum(v for f, v in dense.items() if owners[f][0] == s) + sum(
            v for f, v in stacks.items() if owners[f][0] == es
        )
        masters = momentum = owned * E  # one replica: the owner column is the global owner
        resident = fsdp + masters + momentum + 2 * fsdp + (fsdp + momentum)
        assert mem["resident_total"]["per_rank"][g] == pytest.approx(resident, rel=1e-12), g
        broadcasts = 2 * ((n - 1) / n * p_m + (g_e - 1) / g_e * p_e) * E  # Z3: forward and backward
        reduces = ((n - 1) / n * (p_m + len(dense)) + (g_e - 1) / g_e * (p_e + len(stacks))) * E  # + has-grad flags
        assert comm["dmuon_total_bytes"]["per_rank"][g] == pytest.approx(broadcasts + reduces, rel=1e-12), g
    adamw = 3 * ((n - 1) / n * p_m + (g_e - 1) / g_e * p_e) * E  # all-gather twice (resharded), reduce-scatter
    assert comm["fsdp2_adamw_bytes"]["total"] == pytest.approx(adamw, rel=1e-12)
    naive = adamw + (n - 1) / n * (p_m + ep * p_e) * E  # every full grad: dense over 4 shards, stacks over 2 x 2
    assert comm["naive_fsdp2_muon_bytes"]["total"] == pytest.approx(naive, rel=1e-12)
    a2a = comm["moe_all_to_all"]  # per layer: dispatch, combine and both grads; half of the rows stay home
    assert a2a["bytes"] == pytest.approx(4 * 2 * BATCH * SEQ * 2 * 64 * E * (ep - 1) / ep, rel=1e-12)
    assert a2a["ac_recompute_bytes"] == 0 and a2a["counts_bytes"] == 2 * 8 * 8 * (ep - 1) / ep
