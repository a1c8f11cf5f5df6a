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
