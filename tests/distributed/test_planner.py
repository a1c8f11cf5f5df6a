"""The dry-run planner (titan_dmuon/planner.py) against real gloo runs, and on the shipped 8B / 70B configs.

A real 4-rank run of the debug model measures, on every rank, after its second step: the DMuon ledger
(dmuon.comm_stats: elements and bytes per collective kind) and the resident tensors (FSDP2 param shards,
DMuon fp32 masters, Muon momentum, AdamW moments, and the gradients just before the step). The planner,
built once on a fake process group, must give every rank exactly those figures.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import run_distributed

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
    "dp2xtp2-bf16": ["--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"],
}
MEMORY = ("fsdp_param_shards", "dmuon_fp32_masters", "muon_momentum", "adamw_moments", "gradients")


def dry_run(argv: list[str], world_size: int, out: Path, timeout: float = 300) -> tuple[dict, float]:
    """`train.py --job.dry_run` in its own process (the fake process group wants a fresh one): (JSON, CPU seconds
    of that process: other jobs on this shared machine stretch the wall time, not the work)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "train.py", *argv, "--job.dry_run", "--job.dry_run_world_size", str(world_size)]
    proc = subprocess.run(
        [*cmd, "--job.dry_run_json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Bytes per step per rank" in proc.stdout and "LPT plan" in proc.stdout, proc.stdout
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
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
            grads["gradients"] = sum(nbytes(p.grad) for p in others if p.grad is not None) + sum(
                nbytes(dp._reduced_grad) for dp in dps if dp._reduced_grad is not None
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,world,extra",
    [
        ("llama3_8b.toml", 64, []),
        (
            "llama3_70b.toml",
            256,
            ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.tensor_parallel_degree", "1"],
        ),
    ],
    ids=["8B-64", "70B-256-hsdp4x64"],
)
def test_shipped_configs_plan_within_a_minute(config, world, extra, tmp_path) -> None:
    """Within a minute of CPU (the process: imports included) and 4 GiB of RSS."""
    planned, seconds = dry_run(["--config", f"train_configs/{config}", *extra], world, tmp_path / "plan.json")
    assert seconds < 60 and planned["planner"]["max_rss_bytes"] < 4 * 2**30, (seconds, planned["planner"])
    c, mem, lpt, comm = planned["config"], planned["memory_bytes"], planned["lpt"], planned["bytes_per_step"]
    assert c["world_size"] == world and len(mem["resident_total"]["per_rank"]) == world
    assert lpt["matrices"] == 7 * {"llama3_8b.toml": 32, "llama3_70b.toml": 80}[config]
    assert lpt["ns_flops_lower_bound"] <= lpt["ns_flops_per_rank"]["max"] <= 1.25 * lpt["ns_flops_lower_bound"]
    n = c["mesh"]["shard"]
    p_m = comm["p_m_elements"]
    assert comm["dmuon_elements"]["broadcast"]["max"] == pytest.approx(2 * (n - 1) / n * p_m)  # Z3
    # the reduce carries one has-grad flag per matrix besides the grads
    assert comm["dmuon_elements"]["reduce"]["max"] == pytest.approx((n - 1) / n * (p_m + lpt["matrices"]))
    assert comm["dmuon_total_bytes"]["max"] < comm["naive_fsdp2_muon_bytes"]["total"]
    # each rank holds its share: the fp32 masters add up to the Muon matrices once per replicate row and TP rank
    copies = c["mesh"]["replicate"] * c["mesh"]["tp"]
    assert sum(mem["dmuon_fp32_masters"]["per_rank"]) == pytest.approx(4 * p_m * copies)
