"""Stopping on a signal: what SLURM sends at preemption or before the time limit (SIGTERM, or the SIGUSR1 warning
`scripts/multinode_trainer.slurm` asks for), and Ctrl-C (SIGINT).

A signal reaches the ranks at different times (or only some of them), so a rank never stops on its own: the handler
only records the signal, each rank contributes "I got one" to a reduction every step already makes (the trainer's
loss all-reduce), and the trainer reads the sum on its read steps (log, checkpoint and validation steps and every
10th: no host sync on the others, titan_dmuon/trainer.py `read_due`), so every rank sees the same sum after the
same step, at most 9 steps after the signal. They then finish that step, save a checkpoint there and exit with
`exit_code(signal)`. Signals that come while they do so are recorded and ignored:
a second Ctrl-C or SIGTERM cannot interrupt the save. Set-up and tear-down keep the default handlers.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by `signum` after saving: 128 + the signal number, the shell's convention for
    "ended by this signal" (143 SIGTERM, 138 SIGUSR1, 130 SIGINT), so a launcher tells a stop from a finished run
    (0) and a failure (1, 2) and can requeue it."""
    return 128 + int(signum)


class StopRequested(Exception):
    """Every rank stopped at `step` after a stop signal; `saved` says whether a checkpoint holds that step."""

    def __init__(self, signum: int, step: int, saved: bool):
        self.signum, self.step, self.saved = signum, step, saved
        what = (
            f"checkpoint step-{step} saved: rerun the same command to resume"
            if saved
            else "nothing saved: checkpoints are off (with --checkpoint.enable true a stop saves one, and rerunning "
            "the same command resumes from it)"
        )
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {what}")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopSignals:
    """The stop signals this process received while `installed()`: the first one is kept (`received`)."""

    def __init__(self) -> None:
        self.received: int | None = None

    @property
    def pending(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:  # later ones (a second Ctrl-C during the save) change nothing
            self.received = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Record SIGTERM, SIGUSR1 and SIGINT instead of dying (in the main thread; elsewhere a no-op, as Python
        only lets the main thread set handlers); the previous handlers come back on exit unless a stop signal came
        (then the process saves, closes and exits, and further signals must not kill it half-way)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            if self.received is None:  # once stopping, the process only saves, closes and exits: stay deaf
                for s, handler in previous.items():
                    signal.signal(s, handler)
