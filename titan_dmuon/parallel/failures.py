"""A collective that failed because a peer died or hung becomes one clear error that ends the job.

gloo raises in the waiting rank: "Timed out waiting Nms for recv operation" when a peer is hung (or stopped), or
"Connection closed by peer" / "Connection reset by peer" when its process is gone. `comm_failures` turns such an
exception into `CommFailureError`, whose message says which rank on which host saw it, after how long, and which
peers the heartbeat watcher found silent; train.py logs it and exits 1 (no traceback: the stack of the waiting rank
says nothing about the peer). Any other error propagates unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist

_TIMEOUT_MARKS = ("timed out", "timeout")
_LOST_PEER_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


class CommFailureError(RuntimeError):
    """A collective failed because a peer rank is dead or hung; the message names this rank, its host and what the
    heartbeat knows of the peers."""


def comm_failure_kind(exc: BaseException) -> str | None:
    """The kind of communication failure: "timeout", "lost peer", or None for any other error (the exception's
    causes are looked through too)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if isinstance(e, (RuntimeError, dist.DistError)) and ("gloo" in text or isinstance(e, dist.DistError)):
            if any(m in text for m in _TIMEOUT_MARKS):
                return "timeout"
            if any(m in text for m in _LOST_PEER_MARKS):
                return "lost peer"
        e = e.__cause__ or e.__context__
    return None


def describe_comm_failure(
    exc: BaseException, rank: int, host: str, timeout_s: float, silent: list[tuple[int, str, float]]
) -> str | None:
    """The one-line report of a communication failure, or None when `exc` is not one."""
    kind = comm_failure_kind(exc)
    if kind is None:
        return None
    if kind == "timeout":
        what = f"collective timed out after {timeout_s:g} s (a peer is dead or hung)"
    else:
        what = "a peer's connection closed during a collective (its process is gone)"
    if silent:
        peers = ", ".join(f"rank {r} on host {h} (no heartbeat for {s:.0f} s)" for r, h, s in silent)
        named = f"; silent peers: {peers}"
    else:
        named = "; see the first failed rank in torchrun's summary and the heartbeat warnings of ranks 0 and world-1"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"rank {rank} on host {host}: {what}{named}. Stopping this job. ({first_line[:200]})"


@contextlib.contextmanager
def comm_failures(describe: Callable[[BaseException], str | None]) -> Iterator[None]:
    """Re-raise a communication failure inside the block as CommFailureError(describe(exc))."""
    try:
        yield
    except Exception as e:
        message = describe(e)
        if message is None:
            raise
        raise CommFailureError(message) from e
