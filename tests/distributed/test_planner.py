"""The dry-run planner (titan_dmuon/planner/) against real gloo runs, and on the shipped 8B / 70B configs.

A real 4-rank run of the debug model measures, on every rank, after its second step: the DMuon ledger
(dmuon.comm_stats: elements and bytes per collective kind) and the resident tensors (FSDP2 param shards,
DMuon fp32 masters, Muon momentum, AdamW moments, and the gradients just before the step). The planner,
built once on a fake process group, must give every rank exactly those figures. The MoE layouts (qwen3
debugmodel_moe with expert parallelism) hold its expert axes to a real run the same way: the expert stacks'
broadcasts and reduces over the expert shard group, their masters, momentum and grads on their owners.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._dist import run_distributed, run_script

REPO = Path(__file__).resolve().parents[2]
DEBUG = [
    "--config",
    "train_configs/debug_model.toml",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "32",
    "--training.seed",
    "3",
    "--metrics.enable_tensorboard",
    "false",
]
LAYOUTS = {
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    # per-head Muon: wq/wk/wv hold whole heads in each TP shard (NS there, no gather); wo and the MLP are gathered
    "dp2xtp2-bf16-per-head": [
        *("--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"),
        *("--optimizer.muon.per_head", "true"),
    ],
    # the distributed Gram on the MLP (gram: momentum on the shards), the attention gathered from the backward
    # (momentum whole on each matrix's TP owner): per-rank momentum and gradient bytes follow the TP owners
    "dp2xtp2-gram": [
        *("--parallelism.tensor_parallel_degree", "2", "--optimizer.dmuon.tp_distributed_gram", "true"),
    ],
}
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"]
MOE_LAYOUTS = {
    # EP 2 x TP 2: the expert shard group is the TP pair (G_e = 2), the stacks' NS local, the attention gathered
    "moe-ep2xtp2": [*MOE, "--parallelism.tensor_parallel_degree", "2"],
    # EP 2 inside HSDP 2 x 2: G_e = 1 (no expert broadcast), the stacks' replicate reduce and publish
    "moe-ep2-hsdp2x2": [*MOE, "--parallelism.data_parallel_replicate_degree", "2"],
}
LAYOUTS |= MOE_LAYOUTS
MEMORY = ("fsdp_param_shards", "dmuon_fp32_masters", "muon_momentum", "adamw_moments", "gradients")


def dry_run(
    argv: list[str], world_size: int, out: Path, timeout: float = 300, cold: bool = False
) -> tuple[dict, float]:
    """`train.py --job.dry_run` in a process of its own (the fake process group wants a fresh one): (JSON, CPU
    seconds of that process). `cold`: a new interpreter, its imports counted (other jobs on this shared machine
    stretch the wall time, not the work); otherwise forked by the test harness (tests/_dist.py `run_script`),
    its CPU time not measured (NaN)."""
    cmd = ["train.py", *argv, "--job.dry_run", "--job.dry_run_world_size", str(world_size), "--job.dry_run_json"]
    cpu = float("nan")
    if cold:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            [sys.executable, *cmd, str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    else:
        proc = run_script(1, cmd[0], [*cmd[1:], str(out)], cwd=str(REPO), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Bytes per step per rank" in proc.stdout and "LPT plan" in proc.stdout, proc.stdout
    return json.loads(out.read_text()), cpu


def measure(rank: int, world_size: int, argv: list[str]) -> dict:
    """Two training steps; this rank's ledger and resident tensor bytes (gradients: just before step 2)."""
    from torch.distributed.tensor import DTensor

    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    def nbytes(t) -> float:
        t = t.to_local() if isinstance(t, DTensor) else t
        return float(t.numel() * t.element_size())

    trainer = Trainer(parse_args(argv))
    try:
        model, opt = trainer.model, trainer.optimizer
        dps = dmuon.get_dedicated_params(model)
        dedicated = {dp.param for dp in dps}
        others = [p for p in model.parameters() if p not in dedicated]
        grads = {}
        step = opt.step

        def step_and_record(*args, **kwargs):
            # FSDP2's grads, the owners' reduced grads, and the TP owners' grads gathered from the backward
            gathered = [g for dp in dps if dp._tp_gather is not None for g in dp._tp_gather.gathered or ()]
            grads["gradients"] = (
                sum(nbytes(p.grad) for p in others if p.grad is not None)
                + sum(nbytes(dp._reduced_grad) for dp in dps if dp._reduced_grad is not None)
                + sum(nbytes(g) for g in gathered)
            )
            return step(*args, **kwargs)

        opt.step = step_and_record
        data = iter(trainer.dataloader)
        for _ in range(2):
            trainer.train_step(data)
        stats = dmuon.comm_stats(model)
        return {
            "elements": stats["elements"],
            "bytes": stats["bytes"],
            "fsdp_param_shards": sum(nbytes(p) for p in others),
            "dmuon_fp32_masters": sum(nbytes(dp._owned_data) for dp in dps if dp._owned_data is not None),
            "muon_momentum": sum(nbytes(opt.state[p]["momentum_buffer"]) for p in dedicated if opt.state.get(p)),
            "adamw_moments": sum(nbytes(opt.state[p][k]) for p in others for k in ("exp_avg", "exp_avg_sq")),
            **grads,
        }
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_equals_a_real_four_rank_run(layout, tmp_path) -> None:
    argv = [*DEBUG, "--job.dump_folder", str(tmp_path / "run"), *LAYOUTS[layout]]
    planned, _ = dry_run(argv, 4, tmp_path / "plan.json")
    measured = run_distributed(measure, 4, argv)
    comm, memory = planned["bytes_per_step"], planned["memory_bytes"]
    for rank, got in enumerate(measured):
        for key in MEMORY:
            assert got[key] == pytest.approx(memory[key]["per_rank"][rank], rel=1e-12), (layout, rank, key)
        for kind, value in got["elements"].items():
            want = comm["dmuon_elements"][kind]["per_rank"][rank]
            assert value == pytest.approx(want, rel=1e-9, abs=1e-6), (layout, rank, kind)
            assert got["bytes"][kind] == pytest.approx(comm["dmuon_bytes"][kind]["per_rank"][rank], rel=1e-9, abs=1e-6)
    kinds = {k for got in measured for k, v in got["elements"].items() if v > 0}
    assert kinds >= {"broadcast", "reduce"} and kinds & {"replicate_reduce", "tp_gather"}, kinds
    if layout in MOE_LAYOUTS:  # 4 MoE layers of 3 stacks, each rank holding 4 of the 8 experts
        assert comm["expert_stacks"] == 12 and planned["config"]["expert_parallel"]["ep"] == 2
        assert comm["p_e_elements"] == 4 * 3 * 4 * 128 * 256


def test_planner_coordinates_are_the_device_mesh_ones() -> None:
    """The coordinates the planner places every rank at (ParallelDims.coordinates, rank_of, expert_rank_of) are
    those the run's DeviceMeshes give it: each rank of a 16-rank world in turn, on a fake process group, with EP
    (the efsdp x ep split of the shard axis, the flattened expert shard axis under TP) and without."""
    code = textwrap.dedent(
        """
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from titan_dmuon.parallel import ParallelDims

        for R, N, T, E in [(1, 8, 2, 2), (2, 4, 2, 2), (2, 8, 1, 4), (1, 4, 4, 1)]:
            W = R * N * T
            for g in range(W):
                dims = ParallelDims(dp_replicate=R, dp_shard=N, tp=T, world_size=W, ep=E)
                coords = dims.coordinates()
                dist.init_process_group("fake", store=FakeStore(), rank=g, world_size=W)
                dims.build_mesh("cpu")
                meshes = dims.meshes
                for name in ("replicate", "shard", "tp"):
                    assert getattr(meshes, name).get_local_rank() == coords[name][g], (R, N, T, E, g, name)
                if E > 1:
                    es, ep = meshes.expert_dp.get_local_rank(), meshes.ep.get_local_rank()
                    assert (es, ep) == (coords["expert_shard"][g], coords["ep"][g]), (R, N, T, E, g)
                    assert coords["efsdp"][g] == es // T and coords["shard"][g] == coords["efsdp"][g] * E + ep
                    assert dims.expert_rank_of(int(coords["replicate"][g]), es, ep) == g
                assert dims.rank_of(int(coords["replicate"][g]), int(coords["shard"][g]), int(coords["tp"][g])) == g
                dist.destroy_process_group()
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


LAYERS = {"llama3_8b.toml": 32, "llama3_70b.toml": 80, "llama3_405b.toml": 126}
LAYERS |= {"qwen3_30b_a3b.toml": 48, "qwen3_235b_a22b.toml": 94}
GIB = 2.0**30


# the debug model's TP matrices at TP 2 (dim 256, FFN 768): which of a block's take the Gram under each policy
# (Polar Express: 2 Gram all-reduces per NS; the Gram path needs the long side split, dim 1 of a square matrix)
GRAM_OF_POLICY = {
    "beneficial": ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),  # l/s = 3 > 2
    "always": ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention.wo"),  # + wo (row-parallel)
    "never": (),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(GRAM_OF_POLICY))
def test_the_planned_tp_bytes_follow_the_gram_policy(policy, tmp_path) -> None:
    """The dry run of the debug model at dp 2 x tp 2 with tp_distributed_gram under each
    tp_distributed_gram_policy: each matrix's planned path is the one dmuon.Muon takes (the same costs.tp_decision;
    tests/distributed/test_dmuon_costs.py holds it to a real run's ledger), and the tp_* bytes are those paths'
    formulas: per Gram matrix (1 + restarts) all-reduces of 2 (T-1)/T s² fp32 on each TP rank of its DP owner, per
    gathered one (T-1)/T of m x n fp32 gathered and as much scattered."""
    argv = [*DEBUG, "--job.dump_folder", str(tmp_path / "run"), "--parallelism.tensor_parallel_degree", "2"]
    argv += ["--optimizer.dmuon.tp_distributed_gram", "true", "--optimizer.dmuon.tp_distributed_gram_policy", policy]
    planned, _ = dry_run(argv, 4, tmp_path / "plan.json")
    comm, layers = planned["bytes_per_step"], 6
    shapes = {f"attention.{w}": (256, 256) for w in ("wq", "wk", "wv", "wo")}
    shapes |= {"feed_forward.w1": (768, 256), "feed_forward.w3": (768, 256), "feed_forward.w2": (256, 768)}
    gram = GRAM_OF_POLICY[policy]
    want = {f"layers.{i}.{n}.weight": "gram" if n in gram else "gather" for i in range(layers) for n in shapes}
    assert comm["tp_paths"] == want and comm["tp_distributed_gram_policy"] == policy
    segments, f = 2, 1 / 2
    gram_bytes = layers * len(gram) * 2 * segments * 2 * f * 256 * 256 * 4  # on both TP ranks of each DP owner
    gathered = layers * sum(m * n for name, (m, n) in shapes.items() if name not in gram)
    total = {k: sum(comm["dmuon_bytes"][k]["per_rank"]) for k in ("tp_gram", "tp_gather", "tp_scatter")}
    assert total["tp_gram"] == pytest.approx(gram_bytes)
    assert total["tp_gather"] == total["tp_scatter"] == pytest.approx(2 * f * gathered * 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,world,extra",
    # the largest dense cluster, HSDP (the docs' 70B command), the largest MoE cluster: the smaller shipped configs
    # (8B on 8, 70B on 64, 30B-A3B on 16) take the same code paths with smaller numbers
    [
        ("llama3_405b.toml", 1024, []),
        ("llama3_70b.toml", 256, ["--parallelism.data_parallel_replicate_degree", "4"]),
        ("qwen3_235b_a22b.toml", 256, []),
    ],
    ids=["405B-1024", "70B-256-hsdp4", "235B-A22B-256 (EP 8)"],
)
def test_shipped_configs_plan_within_a_minute(config, world, extra, tmp_path) -> None:
    """At the cluster each config's header names (and docs/training.md's 70B / 256 command), within a minute of CPU (the
    process: imports included) and 4 GiB of RSS, each fits an 80 GiB device, and says so."""
    argv = ["--config", f"train_configs/{config}", *extra]
    planned, seconds = dry_run(argv, world, tmp_path / "plan.json", cold=True)
    assert seconds < 60 and planned["planner"]["max_rss_bytes"] < 4 * 2**30, (seconds, planned["planner"])
    c, mem, lpt, comm = planned["config"], planned["memory_bytes"], planned["lpt"], planned["bytes_per_step"]
    assert c["world_size"] == world and len(mem["resident_total"]["per_rank"]) == world
    cap = planned["capacity"]
    assert cap["fits"] and cap["device_bytes"] == 80 * GIB and cap["alternatives"] == []
    assert cap["peak_bytes"] == mem["peak_estimate"]["max"] <= 80 * GIB, mem["peak_estimate"]["max"] / GIB
    assert lpt["matrices"] == 7 * LAYERS[config]  # llama3: 4 attention + 3 MLP; Qwen3-MoE: 4 + 3 expert stacks
    assert lpt["ns_flops_lower_bound"] <= lpt["ns_flops_per_rank"]["max"] <= 1.25 * lpt["ns_flops_lower_bound"]
    n, r, tp = c["mesh"]["shard"], c["mesh"]["replicate"], c["mesh"]["tp"]
    ep = (c["expert_parallel"] or {}).get("ep", 1)
    # the expert stacks (EP-local P_E, M_E of them) over the G_e ranks of an expert shard group (none: zeros)
    p_m, p_e, m_e = comm["p_m_elements"], comm["p_e_elements"], comm["expert_stacks"]
    g_e = comm["expert_shard_group"] or 1
    assert m_e == (3 * LAYERS[config] if ep > 1 else 0) and (g_e == n // ep * tp if m_e else True)
    broadcast = 2 * ((n - 1) / n * p_m + (g_e - 1) / g_e * p_e)  # Z3
    assert comm["dmuon_elements"]["broadcast"]["max"] == pytest.approx(broadcast)
    # the reduce carries one has-grad flag per matrix besides the grads
    reduce = (n - 1) / n * (p_m + lpt["matrices"] - m_e) + (g_e - 1) / g_e * (p_e + m_e)
    assert comm["dmuon_elements"]["reduce"]["max"] == pytest.approx(reduce)
    assert comm["dmuon_total_bytes"]["max"] < comm["naive_fsdp2_muon_bytes"]["total"]
    # each rank holds its share: the fp32 masters add up to the Muon matrices once per replicate row and TP rank,
    # the expert stacks' once per replicate row and EP rank
    assert sum(mem["dmuon_fp32_masters"]["per_rank"]) == pytest.approx(4 * (p_m * r * tp + p_e * r * ep))
    a2a = comm["moe_all_to_all"]
    if m_e:  # uniform routing: 4 all-to-alls per MoE layer (+ the 2 forward ones again where AC recomputes it)
        t = (ep - 1) / ep * a2a["tokens_per_rank"] * a2a["top_k"] * a2a["dim"] * a2a["element_bytes"]
        assert a2a["bytes"] == pytest.approx(4 * a2a["moe_layers"] * t)
        assert a2a["ac_recompute_bytes"] == pytest.approx(2 * a2a["recomputed_layers"] * t)


@pytest.mark.slow
def test_a_plan_that_does_not_fit_exits_2_with_the_changes_that_fit(tmp_path) -> None:
    """70B on 64 ranks without AC: exit 2, the largest terms, and each alternative with its planned peak, equal
    to what the planner gives when that change is made (so the alternatives are computed, not guessed)."""
    out = tmp_path / "plan.json"
    argv = ["--config", "train_configs/llama3_70b.toml", "--activation_checkpoint.mode", "none"]
    argv += ["--job.dry_run", "--job.dry_run_world_size", "64", "--job.dry_run_json", str(out)]
    proc = run_script(1, "train.py", argv, cwd=str(REPO), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Does not fit" in proc.stdout and "activations kept by the blocks" in proc.stdout, proc.stdout[-3000:]
    assert "error: the plan needs" in proc.stderr and "80 GiB device" in proc.stderr, proc.stderr[-2000:]
    cap = json.loads(out.read_text())["capacity"]
    assert not cap["fits"] and cap["peak_bytes"] > 80 * GIB
    assert cap["largest_terms"][0][0] == "activations kept by the blocks"
    alternatives = {a["change"]: a for a in cap["alternatives"]}
    full = alternatives["--activation_checkpoint.mode full"]
    assert full["fits"]
    assert any(c.startswith("--training.local_batch_size") for c in alternatives), alternatives
    assert all(c in proc.stdout for c in alternatives)
    # the full-AC figure is the plan of the shipped config (full AC), made by the planner itself
    planned, _ = dry_run(["--config", "train_configs/llama3_70b.toml"], 64, tmp_path / "full.json")
    assert full["peak_bytes"] == pytest.approx(planned["capacity"]["peak_bytes"], rel=1e-12)


@pytest.mark.slow
def test_a_larger_tp_degree_is_planned_anew(tmp_path) -> None:
    """8B on 8 ranks, TP 1, no AC, 2 x 8192: larger TP degrees are listed up to the first that fits, and the TP 2
    one is a whole new plan on the same world: its figure is that plan's."""
    out = tmp_path / "plan.json"
    argv = ["--config", "train_configs/llama3_8b.toml", "--activation_checkpoint.mode", "none"]
    argv += ["--training.local_batch_size", "2", "--job.dry_run", "--job.dry_run_world_size", "8"]
    proc = run_script(1, "train.py", [*argv, "--job.dry_run_json", str(out)], cwd=str(REPO), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    alternatives = {a["change"]: a for a in json.loads(out.read_text())["capacity"]["alternatives"]}
    tps = [a for c, a in alternatives.items() if c.startswith("--parallelism.tensor_parallel_degree")]
    assert tps and tps[-1]["fits"] and not any(a["fits"] for a in tps[:-1]), tps  # up to the first that fits
    tp2 = alternatives["--parallelism.tensor_parallel_degree 2"]
    argv = ["--config", "train_configs/llama3_8b.toml", "--activation_checkpoint.mode", "none"]
    argv += ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    argv += ["--job.dry_run_device_memory_gib", "1000"]  # the peak does not depend on the device; this one fits
    planned, _ = dry_run(argv, 8, tmp_path / "tp2.json")
    assert planned["config"]["mesh"] == {"pp": 1, "replicate": 1, "shard": 4, "tp": 2}
    assert tp2["peak_bytes"] == pytest.approx(planned["capacity"]["peak_bytes"], rel=1e-12)


@pytest.mark.parametrize(
    "config, extra, match",
    [
        ("debug_model.toml", ["--parallelism.expert_parallel_degree", "2"], "has no Mixture-of-Experts layer"),
        ("qwen3_moe_debug.toml", ["--parallelism.tensor_parallel_degree", "2"], "they need expert parallelism too"),
        ("qwen3_moe_debug.toml", ["--parallelism.expert_parallel_degree", "3"], r"must divide data_parallel_shard"),
    ],
    ids=["ep-on-a-dense-model", "tp-without-ep-on-moe", "ep-not-dividing-shard"],
)
def test_expert_parallel_misconfigurations_exit_2(config, extra, match) -> None:
    """Expert parallelism that cannot run is a config error naming the fix, before anything is allocated."""
    argv = ["--config", f"train_configs/{config}", *extra, "--job.dry_run", "--job.dry_run_world_size", "4"]
    proc = run_script(1, "train.py", argv, cwd=str(REPO), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(match, proc.stderr), proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,world,pp,stages",
    [("llama3_405b_pp.toml", 1024, 8, 16), ("qwen3_235b_a22b_pp.toml", 256, 4, 8)],
    ids=["405B-pp8", "235B-A22B-pp4"],
)
def test_pipelined_configs_plan_every_stage(config, world, pp, stages, tmp_path) -> None:
    """The pipelined alternatives at their clusters: every pp rank's part planned (its stages hold every block once,
    the embedding on the first stage and the head on the last), each fits an 80 GiB device, the bubble is the
    interleaved schedule's (pp - 1) / (v m + pp - 1), the largest part's peak is the capacity's, and each stage's
    DMuon bytes are below the config's pipeline-free layout's (its DP groups are pp times smaller)."""
    planned, _ = dry_run(["--config", f"train_configs/{config}"], world, tmp_path / "plan.json")
    pipe = planned["pipeline"]
    assert pipe["stages"] == stages and len(pipe["ranks"]) == pp and pipe["warnings"] == []
    held = [m for r in pipe["ranks"] for mods in r["stages"].values() for m in mods]
    n_layers = LAYERS[config.replace("_pp", "")]
    assert sorted(held) == sorted(["tok_embeddings", "norm", "output", *(f"layers.{i}" for i in range(n_layers))])
    v, m = pipe["stages_per_rank"], pipe["microbatches"]
    assert pipe["bubble_fraction"] == pytest.approx((pp - 1) / (v * m + pp - 1))
    peaks = [r["peak_bytes"] for r in pipe["ranks"]]
    cap = planned["capacity"]
    assert cap["fits"] and cap["peak_bytes"] == pytest.approx(max(peaks)) and max(peaks) <= 80 * GIB
    assert all(r["microbatches_in_flight"] <= m and r["p2p_send_bytes"] > 0 for r in pipe["ranks"])
    flat, _ = dry_run(["--config", f"train_configs/{config.replace('_pp', '')}"], world, tmp_path / "flat.json")
    assert max(r["dmuon_bytes"] for r in pipe["ranks"]) < flat["bytes_per_step"]["dmuon_total_bytes"]["max"]
