"""Damaged checkpoints through train.py (checksums.json: titan_dmuon/components/checkpoint/integrity.py), on real gloo
ranks.

A 2-rank FSDP run trains the `tinymodel` flavor 4 steps on a global batch of 8 x 32 tokens, saving asynchronously at
steps 2 and 4 (`source`: checksums.json written by the save's thread). The reference is the run that resumes from a
copy of its step-2 checkpoint alone, as if step 4 had never been saved (`reference`): it saves its own step 4.

  damaged newest step   step-4's largest shard truncated, deleted or with one flipped bit: the rerun names the file
                        and the damage in one WARNING line, sets step-4 aside and resumes from step 2: its losses and
                        grad norms and its step-4 checkpoint equal the reference's, bitwise
  nothing intact        the only step damaged, or checkpoint.load_step at a damaged step: exit 2, one line naming the
                        damage and the way forward, and the folder as it was
  keep_latest_k = 1     a rerun saving every step after skipping a damaged step-4: what is left is its own step-4,
                        intact (the damaged one was never counted among the kept)

The references are read back independently of the code under test: losses from the TensorBoard events, checkpoint
tensors with DCP's own reader.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests._dist import run_script
from tests.train_runs import REPO, read_checkpoint, read_scalars, tail, tiny_train_argv

pytestmark = pytest.mark.slow

STEPS = 4


def launch(nproc: int, dump: Path, *args: str) -> subprocess.CompletedProcess:
    """A 4-step run saving at steps 2 and 4, global batch 8 (4 rows per rank on 2 ranks, 8 on one)."""
    argv = ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    argv += ["--training.local_batch_size", str(8 // nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = tiny_train_argv(dump, *argv, *args, seed=42, tensorboard=True)
    return run_script(nproc, "train.py", argv, cwd=str(REPO), env=env, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, tail(proc)
    return proc


def step_names(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self._source: Path | None = None
        self._reference: Path | None = None

    @property
    def source(self) -> Path:
        if self._source is None:
            self._source = self.root / "source"
            _ok(launch(2, self._source, "--checkpoint.async_mode", "async"))  # committed by the save's thread
            assert step_names(self._source) == ["step-2", "step-4"]
        return self._source

    @property
    def reference(self) -> Path:
        """The resume from source's step 2 in a folder that never held a step 4."""
        if self._reference is None:
            self._reference = self.root / "reference"
            copy_steps(self.source, self._reference, 2)
            proc = _ok(launch(2, self._reference))
            assert "Resumed at step 2" in proc.stdout + proc.stderr
        return self._reference


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("damage"))


def copy_steps(source: Path, dump: Path, *steps: int) -> Path:
    (dump / "checkpoint").mkdir(parents=True)
    for step in steps:
        shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump / "checkpoint"


def damage(step: Path, how: str) -> str:
    """Damage the step's largest shard: truncate it to half, delete it, or flip one bit in its middle; its name."""
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    if how == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        shard.unlink()
    else:
        middle = len(data) // 2
        shard.write_bytes(data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :])
    return shard.name


WHAT = {
    "truncate": r" is \d+ bytes, \d+ expected \(truncated\)",
    "delete": r" is missing",
    "flip": r": bytes \d+-\d+ differ from their checksum \(changed since the save\)",
}


@pytest.mark.parametrize("how", ["truncate", "delete", "flip"])
def test_damaged_newest_step_resumes_from_the_step_before(runs, tmp_path, how):
    """step-4 damaged: one WARNING names the file and the damage, the run resumes from step 2 and trains and saves
    exactly as the resume of a folder that never held step 4 (losses, grad norms, the step-4 checkpoint: ==)."""
    folder = copy_steps(runs.source, tmp_path, 2, 4)
    shard = damage(folder / "step-4", how)
    proc = _ok(launch(2, tmp_path))
    text = proc.stdout + proc.stderr
    warnings = [line for line in text.splitlines() if "is damaged" in line]
    assert len(warnings) == 1, warnings
    assert re.search(
        rf"WARNING.*checkpoint: \S+/step-4 is damaged \({re.escape(shard)}{WHAT[how]}, found by rank \d\); "
        r"resuming from step-2, the newest intact checkpoint; moved to step-4\.damaged-[0-9a-f]+",
        warnings[0],
    ), warnings[0]
    assert "Resumed at step 2" in text

    got, want = read_scalars(tmp_path / "tb"), read_scalars(runs.reference / "tb")
    for tag in ("loss/train", "grad_norm"):
        assert sorted(got[tag]) == sorted(want[tag]) == [3, 4], tag
        assert all(got[tag][s] == want[tag][s] for s in (3, 4)), (tag, got[tag], want[tag])
    got, want = (read_checkpoint(d / "checkpoint" / "step-4") for d in (tmp_path, runs.reference))
    assert sorted(got) == sorted(want)
    assert any(k.startswith("optimizer.state.") for k in got) and any(k.startswith("model.") for k in got)
    for key in want:  # weights, optimizer state, schedule, data position, RNG states: bitwise
        if key != "train_state.elapsed_s":  # wall time
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, equal_nan=True, msg=key)
    names = step_names(tmp_path)  # the damaged step set aside, out of the way of this run's save of step 4
    assert len(names) == 3 and names[:2] == ["step-2", "step-4"], names
    assert re.fullmatch(r"step-4\.damaged-[0-9a-f]+", names[2]), names


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    ("steps", "args", "match"),
    [
        (
            [4],
            [],
            r"^config error: checkpoint: no intact checkpoint in \S+/checkpoint \(step-4: __\d_0\.distcp is \d+ bytes, "
            r"\d+ expected \(truncated\)\): move the damaged step folder\(s\) away to start from scratch, or set "
            r"checkpoint\.load_step or checkpoint\.initial_load_path$",
        ),
        (
            [2, 4],
            ["--checkpoint.load_step", "4"],
            r"^config error: checkpoint\.load_step = 4: \S+/step-4 is damaged \(__\d_0\.distcp is \d+ bytes, \d+ "
            r"expected \(truncated\)\); set checkpoint\.load_step to another step, or move the folder away$",
        ),
    ],
    ids=["only_step", "load_step"],
)
def test_no_intact_step_exits_2_with_one_line(runs, tmp_path, steps, args, match):
    """One process (the 2-rank checkpoint on one rank, as any layout loads it), so the exit status is train.py's."""
    folder = copy_steps(runs.source, tmp_path, *steps)
    damage(folder / "step-4", "truncate")
    before = _fingerprint(folder)
    proc = launch(1, tmp_path, *args)
    assert proc.returncode == 2, tail(proc)
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text
    (line,) = [line for line in text.splitlines() if "config error" in line]
    assert re.search(match, line), line
    assert not [line for line in text.splitlines() if "WARNING" in line and "damaged" in line]
    assert _fingerprint(folder) == before


def test_keep_latest_k_1_keeps_an_intact_step(runs, tmp_path):
    """keep_latest_k = 1, a save every step, step-4 damaged: the rerun resumes from step 2 and saves 3 and 4; the
    damaged step is not one of the kept, so what is left is the rerun's own step 4, intact, beside the damaged one
    set aside."""
    from titan_dmuon.components.checkpoint.integrity import verify

    folder = copy_steps(runs.source, tmp_path, 2, 4)
    damage(folder / "step-4", "truncate")
    _ok(launch(1, tmp_path, "--checkpoint.keep_latest_k", "1", "--checkpoint.interval", "1"))
    assert verify(folder / "step-4") is None
    assert read_checkpoint(folder / "step-4")["train_state.step"].item() == 4
    names = step_names(tmp_path)
    assert names[0] == "step-4" and len(names) == 2 and re.fullmatch(r"step-4\.damaged-[0-9a-f]+", names[1]), names


def test_damaged_newest_step_under_tp_resumes_from_the_step_before(tmp_path):
    """dp2 x tp2 on 4 ranks: only the rank whose share of the files holds the truncated shard sees the damage and
    stops its check early; the others build the load's template, which under TP is a collective (a TP owner's
    whole momentum is scattered into the TP shards a checkpoint holds). Built on every rank before any check may
    stop, it cannot hang: the rerun names the damage and resumes from step 2."""
    tp = ("--parallelism.tensor_parallel_degree", "2")
    _ok(launch(4, tmp_path, *tp))
    assert step_names(tmp_path) == ["step-2", "step-4"]
    shard = damage(tmp_path / "checkpoint" / "step-4", "truncate")
    text = "".join((lambda p: [p.stdout, p.stderr])(_ok(launch(4, tmp_path, *tp))))
    warnings = [line for line in text.splitlines() if "is damaged" in line]
    assert len(warnings) == 1 and shard in warnings[0], warnings
    assert "Resumed at step 2" in text
