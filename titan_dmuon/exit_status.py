"""How a rank's exit status reaches the user through our launchers (`run_train.sh`, the SLURM script).

torchrun turns any worker's non-zero exit into a `ChildFailedError` traceback of its own and exit 1, whatever the
worker said. For the ends a run expects and explains in one line (a config error: 2; a stop signal after a
saved checkpoint: 128 + N) that traceback hides the message and the code. So under a launcher
that sets `TITAN_DMUON_STATUS_DIR`, each rank writes its exit status to a file there and exits 0; the launcher,
once torchrun is done, exits with the largest status written. A rank that crashes (an uncaught exception) writes
nothing and exits 1 as before, and torchrun's report of it stands. Without the variable (plain `python train.py`,
a bare torchrun) the status is the exit code itself.

It lives outside `parallel/` and imports only the standard library: the launchers run `python -m
titan_dmuon.exit_status signal ...` to pass a stop signal on, and it must arrive in milliseconds, not after
importing torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

ENV = "TITAN_DMUON_STATUS_DIR"


def report(status: int, message: str | None = None) -> int:
    """The exit code for `status` (an end the run explained, with the one-line `message` it prints, if any).

    Under a launcher, a config error (2) or a stop after a signal (128 + N), ends every rank meets alike: both go to
    this rank's status file (the launcher prints each distinct message once) and the code is 0. Anything else (a
    divergence, a dead peer: 1) keeps its code, so that torchrun and srun stop the other ranks and nodes as before.
    Otherwise the message goes to stderr and the code is `status`."""
    folder = os.environ.get(ENV)
    if folder and (status == 2 or status > 128):
        path = Path(folder) / f"rank-{os.environ.get('RANK', '0')}"
        try:
            path.write_text(f"{status}\n{message or ''}\n")
            return 0
        except OSError:
            pass  # the launcher's folder is gone: say it the plain way
    if message:
        print(message, file=sys.stderr, flush=True)
    return status


# ---- the launcher's side -----------------------------------------------------------------------------------
def register() -> None:
    """Under a launcher: record this training process (`pid-<rank>`: its node and pid), so the launcher can signal
    the training processes of a node without signalling torchrun (see `signal_node`)."""
    folder = os.environ.get(ENV)
    if not folder or "RANK" not in os.environ:
        return
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    with contextlib.suppress(OSError):
        (Path(folder) / f"pid-{os.environ['RANK']}").write_text(f"{node} {os.getpid()}\n")


def signal_node(folder: Path, signum: int, node: str) -> int:
    """Send `signum` to the training processes `register` recorded on `node`; how many were signalled."""
    sent = 0
    for path in sorted(folder.glob("pid-*")):
        with contextlib.suppress(OSError, ValueError):
            where, pid = path.read_text().split()
            if where == node:
                os.kill(int(pid), signum)
                sent += 1
    return sent


def collect(folder: Path) -> int:
    """The largest status the ranks wrote (0 if none), after printing each distinct message once, in rank order."""
    status, seen = 0, set()
    files = sorted(folder.glob("rank-*"), key=lambda p: int(p.name.split("-", 1)[1]))
    for path in files:
        code, _, message = path.read_text().partition("\n")
        status = max(status, int(code))
        message = message.strip("\n")
        if message and message not in seen:
            seen.add(message)
            print(message, file=sys.stderr, flush=True)
    return status


def main(argv: list[str]) -> int:
    """`python -m titan_dmuon.exit_status collect`: the run's status from `$TITAN_DMUON_STATUS_DIR`;
    `... signal SIGNAME`: signal this node's training processes (node: `SLURMD_NODENAME`, else the host name)."""
    folder = Path(os.environ[ENV])
    if argv[:1] == ["collect"]:
        return collect(folder)
    if argv[:1] == ["signal"] and len(argv) == 2:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        signal_node(folder, int(getattr(signal, argv[1] if argv[1].startswith("SIG") else f"SIG{argv[1]}")), node)
        return 0
    print("usage: python -m titan_dmuon.exit_status collect | signal SIGNAME", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
