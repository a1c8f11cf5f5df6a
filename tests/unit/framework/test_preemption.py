"""The pieces of a clean stop in one process: the stop-signal recorder and the launcher's status files (the whole
path, on 2 ranks through run_train.sh, is tests/integration/test_preemption.py)."""

from __future__ import annotations

import os
import signal

from titan_dmuon import exit_status
from titan_dmuon.parallel.preemption import StopRequested, StopSignals, exit_code


def test_stop_signals_record_the_first_and_outlive_it() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process with the default handler
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: ignored
        assert stop.received == signal.SIGUSR1 and stop.pending
    # once stopping, the process stays deaf to them until it exits (a second Ctrl-C cannot cut the save short)
    assert signal.getsignal(signal.SIGUSR1) == stop._handle
    signal.signal(signal.SIGUSR1, before)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_without_a_signal_the_previous_handlers_come_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with StopSignals().installed() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert {s: signal.getsignal(s) for s in before} == before


def test_exit_codes_and_the_message() -> None:
    assert [exit_code(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)] == [143, 138, 130]
    e = StopRequested(signal.SIGTERM, 23, saved=True)
    assert e.exit_code == 143 and str(e) == (
        "stopped by SIGTERM after step 23; checkpoint step-23 saved: rerun the same command to resume"
    )
    assert str(StopRequested(signal.SIGINT, 5, saved=False)) == (
        "stopped by SIGINT after step 5; nothing saved: checkpoints are off (with --checkpoint.enable true a stop "
        "saves one, and rerunning the same command resumes from it)"
    )


def test_status_goes_to_the_launcher_folder_or_the_exit_code(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv(exit_status.ENV, raising=False)
    assert exit_status.report(2, "config error: x") == 2
    assert capsys.readouterr().err == "config error: x\n"
    monkeypatch.setenv(exit_status.ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert exit_status.report(143) == 0 and exit_status.report(0) == 0
    assert (tmp_path / "rank-3").read_text() == "143\n\n"
    assert exit_status.report(1) == 1  # a dead peer or a divergence: torchrun and srun must see it
    assert (tmp_path / "rank-3").read_text() == "143\n\n"
    assert exit_status.report(2, "config error: y") == 0
    assert (tmp_path / "rank-3").read_text() == "2\nconfig error: y\n" and capsys.readouterr().err == ""
