"""Stopping on a signal through our launcher (`run_train.sh`, 2 gloo ranks under torchrun): SIGTERM (preemption,
time limit), SIGUSR1 (the SLURM script's warning) and SIGINT (Ctrl-C) sent mid-run to the launcher each stop every
rank after the same step with a checkpoint of it, exit 128 + the signal, with one line and no traceback; the
rerun of the same command resumes there, and its losses equal an uninterrupted run's bitwise. A second SIGTERM
while the ranks stop changes nothing. And the launcher's one-message exit 2 for a bad flag or a missing dataset.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests._dist import run_script
from tests.train_runs import read_checkpoint, read_scalars

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
pytestmark = pytest.mark.slow


def _argv(dump: Path) -> list[str]:
    return [
        "--model.flavor",
        "tinymodel",
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.async_mode",
        "async",
        "--comm.heartbeat_seconds",
        "0",
        "--job.dump_folder",
        str(dump),
    ]


def _launch(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(
            ["./run_train.sh", *argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            # As from a terminal: a shell that starts with SIGINT ignored (pytest itself run in the background,
            # `cmd &`) cannot trap it, and Ctrl-C would not reach the ranks.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def _logged_steps(text: str) -> list[int]:
    """The steps of the console's metric lines (`step:    5/40  loss: ...`)."""
    return [int(m) for m in re.findall(r"step:\s+(\d+)/", text)]


def _wait_for_step(log: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(_logged_steps(log.read_text()), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step >= {step} logged in {timeout} s:\n{log.read_text()[-3000:]}")


def _losses(dump: Path) -> dict[int, float]:
    return read_scalars(dump / "tb")["loss/train"]


def _run(argv: list[str], log: Path, timeout: float = 300) -> int:
    proc = _launch(argv, log)
    return proc.wait(timeout=timeout)


def _train(argv: list[str], log: Path) -> int:
    """A run that no signal stops (the reference run, a resume): train.py on 2 ranks as torchrun starts them,
    forked by the test harness (tests/_dist.py `run_script`); the launcher itself is what `_launch` tests."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["--config", "train_configs/debug_model.toml", *argv]  # what run_train.sh passes first
    proc = run_script(2, "train.py", argv, cwd=str(REPO), env=env, timeout=300)
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("straight")
    assert _train(_argv(dump), dump.parent / "straight.log") == 0
    losses = _losses(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


# SIGUSR1 (SLURM's warning before the time limit) takes this path too: tests/integration/test_multinode.py sends it
# through the SLURM script and checks the stop, the save and the requeued run's resume
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_saves_the_step_reached_and_the_rerun_resumes_bitwise(tmp_path, straight, sig) -> None:
    dump, log = tmp_path / "run", tmp_path / "stopped.log"
    proc = _launch(_argv(dump), log)
    _wait_for_step(log, 3)
    proc.send_signal(sig)
    if sig == signal.SIGTERM:  # a second one while the ranks stop and save: ignored
        time.sleep(0.3)
        proc.send_signal(sig)
    rc = proc.wait(timeout=240)
    text = log.read_text()
    assert rc == 128 + sig, f"exit {rc}\n{text[-4000:]}"
    assert "Traceback" not in text, text[-4000:]
    (line,) = [ln for ln in text.splitlines() if f"stopped by {sig.name} after step" in ln]
    step = int(line.split("after step ")[1].split(";")[0])
    assert 3 <= step < STEPS and f"checkpoint step-{step} saved" in line, line
    assert [p.name for p in (dump / "checkpoint").iterdir()] == [f"step-{step}"]

    resumed = tmp_path / "resumed.log"
    assert _train(_argv(dump), resumed) == 0, resumed.read_text()[-4000:]
    assert _logged_steps(resumed.read_text())[0] == step + 1, resumed.read_text()[-4000:]  # resumed, not restarted
    losses = _losses(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert {s: losses[s] for s in range(step + 1, STEPS + 1)} == {s: straight[s] for s in range(step + 1, STEPS + 1)}


def test_a_bad_flag_or_missing_dataset_is_one_message_and_exit_2(tmp_path) -> None:
    for argv, needle in [
        (["--training.stepz", "5"], "config error: unknown flag --training.stepz; did you mean --training.steps?"),
        (["--training.dataset", "parquet", "--training.dataset_path", str(tmp_path / "nope")], "does not exist"),
    ]:
        log = tmp_path / "out.log"
        rc = _run([*argv, "--job.dump_folder", str(tmp_path / "d")], log)
        text = log.read_text()
        assert rc == 2, f"exit {rc}\n{text[-3000:]}"
        assert text.count(needle) == 1, text[-3000:]
        assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]


def test_without_checkpoints_a_stop_says_nothing_was_saved(tmp_path) -> None:
    dump, log = tmp_path / "run", tmp_path / "stopped.log"
    argv = [*_argv(dump), "--checkpoint.enable", "false"]
    proc = _launch(argv, log)
    _wait_for_step(log, 3)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=240)
    text = log.read_text()
    assert rc == 143, f"exit {rc}\n{text[-4000:]}"
    said = r"stopped by SIGTERM after step \d+; nothing saved: checkpoints are off \(with --checkpoint.enable true "
    assert re.search(said, text), text[-4000:]
    assert "Traceback" not in text and not (dump / "checkpoint").exists()


# ---- one rank signalled alone ------------------------------------------------------------------------------------
# A node preempted alone: only its ranks get SIGTERM. This wrapper runs train.py with Trainer.train_step patched so
# that rank SIGNAL_RANK sends itself SIGTERM as its step SIGNAL_STEP begins (before that step's all-reduce): the
# signal lands on that rank and nowhere else, at a known step, without a timed wait.
_SIGNAL_ONE_RANK = """
import os, runpy, signal, sys

from titan_dmuon.trainer import Trainer

RANK, STEP, TRAIN_PY = int(os.environ["SIGNAL_RANK"]), int(os.environ["SIGNAL_STEP"]), os.environ["TRAIN_PY"]
train_step = Trainer.train_step


def signalled_train_step(self, data_iter):
    if self.rank == RANK and self.step == STEP:
        os.kill(os.getpid(), signal.SIGTERM)
    return train_step(self, data_iter)


Trainer.train_step = signalled_train_step
sys.argv[0] = TRAIN_PY
runpy.run_path(TRAIN_PY, run_name="__main__")
"""


@pytest.mark.parametrize("signalled", [0, 1], ids=["rank0", "rank1"])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, signalled) -> None:
    """SIGTERM on one rank of 2 only, as its step 3 begins: both ranks stop after step 3 (the stop flag is agreed in
    the step's all-reduce, not decided per rank), save one checkpoint, step-3, whose tensors equal those of a run
    that trains 3 steps and saves at its end, and both report 143 (the launcher's status files, one per rank). A
    stop decided per rank leaves the other rank training on into a collective its peer never joins."""
    stop_step, status = 3, tmp_path / "status"
    status.mkdir()
    wrapper = tmp_path / "signal_one_rank.py"
    wrapper.write_text(_SIGNAL_ONE_RANK)
    # a warmup shorter than 3 steps and a constant lr after it: the first 3 steps of a 40-step run and of a 3-step
    # run train alike
    lr = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]
    argv = ["--config", "train_configs/debug_model.toml", *_argv(tmp_path / "run"), *lr]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SIGNAL_RANK": str(signalled),
        "SIGNAL_STEP": str(stop_step),
        "TRAIN_PY": str(REPO / "train.py"),
        "TITAN_DMUON_STATUS_DIR": str(status),  # as under run_train.sh: each rank writes its status there
    }
    proc = run_script(2, str(wrapper), argv, cwd=str(REPO), env=env, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{text[-4000:]}"
    assert "Traceback" not in text, text[-4000:]
    assert {p.name: p.read_text() for p in status.glob("rank-*")} == {"rank-0": "143\n\n", "rank-1": "143\n\n"}
    assert f"stopped by SIGTERM after step {stop_step}; checkpoint step-{stop_step} saved" in text, text[-4000:]
    assert max(_logged_steps(text)) == stop_step, text[-4000:]
    folder = tmp_path / "run" / "checkpoint"
    assert [p.name for p in folder.iterdir()] == [f"step-{stop_step}"]

    ref = [*_argv(tmp_path / "ref"), *lr, "--training.steps", str(stop_step)]
    assert _train(ref, tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-4000:]
    got = read_checkpoint(folder / f"step-{stop_step}")
    want = read_checkpoint(tmp_path / "ref" / "checkpoint" / f"step-{stop_step}")
    assert set(got) == set(want) and any(k.startswith("model") for k in got), sorted(set(got) ^ set(want))
    differ = [k for k, v in want.items() if not torch.equal(got[k], v)]
    # the wall time, and Python's RNG (not the run's seed: what each process drew), are each run's own
    assert all(k == "train_state.elapsed_s" or re.fullmatch(r"rng\.rank\d+\.python\w*", k) for k in differ), differ
