"""The benchmark scripts still run end to end on small settings, and what they compare is the same model: DMuon
and naive FSDP2 + Muon (sharded as train.py shards them) end bench_step's run at the same loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: float = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_step_dmuon_and_naive_train_the_same_model() -> None:
    out = _run(
        "scripts/bench_step.py", "--nproc", "2", "--steps", "3", "--warmup", "1", "--d", "32", "--ff", "64",
        "--layers", "2", "--batch", "4", "--z2",
    )  # fmt: skip
    loss = {
        m[1]: float(m[2])
        for m in re.finditer(r"^(\w+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\S+\s+([\d.]+)", out, re.M)
    }
    assert set(loss) == {"dmuon", "dmuon_z2", "naive_fsdp2_muon", "fsdp2_adamw"}, out
    assert loss["dmuon"] == pytest.approx(loss["naive_fsdp2_muon"], rel=1e-5)
    assert loss["dmuon_z2"] == pytest.approx(loss["dmuon"], rel=1e-6)
    assert re.search(r"naive/dmuon [\d.]+x", out), out


@pytest.mark.slow
def test_bench_train_reports_both_optimizers() -> None:
    out = _run(
        "scripts/bench_train.py", "--nproc", "2", "--flavor", "tinymodel", "--steps", "4", "--warmup", "2",
        "--batch", "2", "--seq-len", "32", "--optimizers", "dmuon", "adamw",
    )  # fmt: skip
    assert re.search(r"dmuon [\d.,]+, adamw [\d.,]+ tok/s/rank \| dmuon/adamw = [\d.]+", out), out


def test_bench_train_variants_parse_into_runs_and_step_times() -> None:
    """--variants (no training run): NAME:FLAGS shell-split, crossed with the optimizers, labelled by the variant
    with one optimizer; step time = that step's tokens per rank / its tokens/s; ratios over the first variant."""
    from tests._scripts import load_script

    bench = load_script("bench_train")
    variants = ["backward:--optimizer.dmuon.tp_gather=backward", "step:--optimizer.dmuon.tp_gather step", "base:"]
    args = bench.parse_args(["--variants", *variants])
    assert args.optimizers == ["dmuon"]  # the default with variants: one optimizer
    assert bench.runs_of(args) == {
        "backward": ("dmuon", ["--optimizer.dmuon.tp_gather=backward"]),
        "step": ("dmuon", ["--optimizer.dmuon.tp_gather", "step"]),
        "base": ("dmuon", []),
    }
    two = bench.parse_args(["--optimizers", "dmuon", "adamw", "--variants", "a:--x 1", "b:--x 2"])
    assert list(bench.runs_of(two)) == ["dmuon:a", "dmuon:b", "adamw:a", "adamw:b"]
    assert bench.parse_args([]).optimizers == list(bench.OPTIMIZERS) and bench.parse_args([]).variants is None
    for bad in (["nocolon"], ["a:--x", "a:--y"], ["only:--x"], [":--x", "b:"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--variants", *bad])

    # 4 ranks (dp 2 x tp 2): 1024 tokens per DP rank -> 2048 more tokens_seen per step, 512 per rank.
    steps = bench.measured_steps({1: 1.0, 2: 1024.0, 3: 2048.0}, {1: 2048, 2: 4096, 3: 6144}, warmup=1, ranks=4)
    assert steps.tps == [1024.0, 2048.0] and steps.ms == pytest.approx([500.0, 250.0])
    assert steps.run_ms == pytest.approx([375.0])
    lines = bench.variant_lines(
        args,
        {"backward": steps, "step": bench.Steps([512.0], [1000.0], [1000.0]), "base": bench.Steps([1024.0], [375.0])},
        {label: [1.0, 2.0] for label in ("backward", "step", "base")},
    )
    assert lines[0] == (
        "variant backward: 1,365 tok/s/rank, 375.0 ms/step (median 375.0, min 250.0, max 500.0, 2 steps; per run "
        "375.0), 1-min load 1.0-2.0"
    )
    assert lines[-1] == (
        "dmuon variants: backward 375.0 ms, step 1000.0 ms, base 375.0 ms per step"
        " | step/backward = 2.667, base/backward = 1.000 (step time)"
    )
