"""A script that uses DMuon and ends as the design examples end, with `dist.destroy_process_group()` and nothing
else: the library frees its own process groups at exit (titan_dmuon/dmuon/state.py, `release_at_exit`), on the DDP
and the FSDP2 paths, and the run exits 0. Real torchrun, fresh interpreters: the exit is what is tested."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["ddp", "fsdp2"])
def test_dmuon_frees_its_groups_at_a_clean_exit(path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + ["tests/distributed/exit_check.py", path],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = re.findall(r"DMuon groups alive after its exit hook: (\d+) of (\d+)", proc.stdout)
    assert len(counts) == 2, proc.stdout  # one per rank (found anywhere: the ranks share one stdout)
    for alive, made in counts:
        assert int(made) >= 1 and int(alive) == 0, (alive, made)
