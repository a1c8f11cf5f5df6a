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

from tests._dist import run_script
from tests.train_runs import read_scalars

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
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
        (["--training.stepz", "5"], "Unrecognized options: --training.stepz"),
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
    assert re.search(r"stopped by SIGTERM after step \d+; nothing saved", text), text[-4000:]
    assert "Traceback" not in text and not (dump / "checkpoint").exists()
