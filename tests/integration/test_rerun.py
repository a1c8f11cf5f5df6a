"""Rerunning a train.py run in its folder, as a user extends or repeats one (1 process, the tinymodel, 6 steps with
checkpoints at steps 4 and 6):

  last line    the run's last line: its final loss and tokens (as TensorBoard has them), training time, and where
               the checkpoint, the TensorBoard events and config.toml are
  longer       step-4 resumed with --training.steps 8 and another AdamW lr: ONE warning names the changed schedule
               fields (old -> new) and each kind's lr at step 4 under the saved schedule and at step 5 under the new
               one; the numbers are the WSD formula worked by hand here, and what TensorBoard holds for those steps
  same         step-4 resumed with the same schedule (another log frequency): no such warning
  finished     the finished run rerun: exit 0, one line saying it is complete and which flag trains further, and the
               dump folder's tree (names, sizes, mtimes) unchanged: no events file, no config.toml, no checkpoint
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.train_runs import read_scalars, run_train, tail, tiny_train_argv

pytestmark = pytest.mark.slow

# The schedule spelled out (decay_ratio is unset in debug_model.toml: the decay takes every step after warmup).
SCHEDULE = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "linear"]
SCHEDULE += ["--lr_scheduler.min_lr_factor", "0.1", "--optimizer.muon.lr", "0.01", "--optimizer.adamw.lr", "3e-3"]
WARNING = "lr schedule changed on resume:"


def _argv(dump: Path, *extra: str) -> list[str]:
    args = ["--training.steps", "6", *SCHEDULE, "--metrics.log_freq", "1"]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    return tiny_train_argv(dump, *args, *extra, tensorboard=True)


def _run(dump: Path, *extra: str) -> str:
    proc = run_train(1, _argv(dump, *extra))
    assert proc.returncode == 0, tail(proc)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[Path, str]:
    """The 6-step run: its dump folder and its log."""
    dump = tmp_path_factory.mktemp("rerun") / "run"
    text = _run(dump)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-4", "step-6"]
    return dump, text


@pytest.fixture
def finished(first) -> Path:
    return first[0]


def test_the_last_line_says_the_final_loss_and_where_the_outputs_are(first):
    dump, text = first
    last = text.strip().splitlines()[-1].split(": ", 1)[1]
    scalars = read_scalars(dump / "tb")
    loss, tokens = scalars["loss/train"][6], int(scalars["progress/tokens_seen"][6])
    assert tokens == 6 * 8 * 32  # 6 steps of 8 rows of 32 tokens
    where = re.escape(f"checkpoint {dump}/checkpoint/step-6, TensorBoard {dump}/tb, config {dump}/config.toml")
    said = rf"Training done: 6 steps, final loss {loss:.4f}, {tokens:,} tokens seen, 0:0\d:\d\d of training; "
    assert re.fullmatch(said + where, last), last
    assert "FSDP2: " not in text  # one process: FSDP2 shards nothing, its unit count says nothing


def _from_step_4(finished: Path, dump: Path) -> None:
    shutil.copytree(finished / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")


def test_a_longer_rerun_warns_once_with_the_lr_before_and_after(finished, tmp_path):
    dump = tmp_path / "run"
    _from_step_4(finished, dump)
    text = _run(dump, "--training.steps", "8", "--optimizer.adamw.lr", "2e-3")
    (line,) = [line.split(": ", 1)[1] for line in text.splitlines() if WARNING in line]
    assert " WARNING " in next(line for line in text.splitlines() if WARNING in line)
    fields, rest = line.split("; ", 1)
    assert fields == f"{WARNING} training.steps 6 -> 8, optimizer.adamw.lr 0.003 -> 0.002", line
    lrs = {k: (float(a), float(b)) for k, a, b in re.findall(r"lr/(\w+) (\S+) -> ([^\s,]+)", rest)}
    assert sorted(lrs) == ["adamw", "muon"], line
    # Saved: 6 steps, warmup 2, decay over 4. Step 4 is 0-indexed step 3, decay progress (3 - 2 + 1) / 5.
    before = 0.1 + 0.9 * (1 - 2 / 5)
    # This run: 8 steps, warmup 2, decay over 6. Step 5 is 0-indexed step 4, decay progress (4 - 2 + 1) / 7.
    after = 0.1 + 0.9 * (1 - 3 / 7)
    want = {"muon": (0.01 * before, 0.01 * after), "adamw": (3e-3 * before, 2e-3 * after)}
    trained_before, trained_after = read_scalars(finished / "tb"), read_scalars(dump / "tb")
    for kind, (b, a) in want.items():
        assert lrs[kind][0] == pytest.approx(b, rel=1e-3) and lrs[kind][1] == pytest.approx(a, rel=1e-3), line
        # and what the runs trained with at those steps
        assert trained_before[f"lr/{kind}"][4] == pytest.approx(b, rel=1e-5)
        assert trained_after[f"lr/{kind}"][5] == pytest.approx(a, rel=1e-5)


def test_a_rerun_with_the_same_schedule_says_nothing_of_it(finished, tmp_path):
    dump = tmp_path / "run"
    _from_step_4(finished, dump)
    text = _run(dump, "--metrics.log_freq", "2", "--checkpoint.interval", "3")
    assert "Resumed at step 4" in text and WARNING not in text, text[-3000:]


def _tree(folder: Path) -> dict[str, tuple[bool, int, int]]:
    """Every entry under `folder` (and itself): whether a folder, its size and its mtime in ns."""
    paths = [folder]
    for root, dirs, files in os.walk(folder):
        paths += [Path(root) / name for name in (*dirs, *files)]
    out = {}
    for path in paths:
        st = path.stat()
        out[str(path.relative_to(folder))] = (path.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def test_rerunning_a_finished_run_writes_nothing(finished, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(finished, dump)
    before = _tree(dump)
    assert "config.toml" in before and any(name.startswith("tb/events.") for name in before)
    text = _run(dump)
    assert _tree(dump) == before
    said = [line for line in text.splitlines() if "the run is complete at step 6" in line]
    assert len(said) == 1 and "rerun with --training.steps M (M > 6)" in said[0], text[-3000:]
    assert "Training done" not in text and "Resumed at step" not in text
