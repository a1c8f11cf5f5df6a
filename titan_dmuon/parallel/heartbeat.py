"""A heartbeat per rank, so a rank that died, was stopped or hung is named (with its host) while the others wait.

Each rank's daemon thread adds 1 to its counter in the rendezvous store (torchrun's TCPStore) every `interval`
seconds; the thread keeps beating while the main thread waits in a collective, so a counter stops only when its
process is gone or frozen. Two watchers (global ranks 0 and world-1, so one survives the loss of the other) read
all counters with one multi_get per interval and log a warning the first time a rank has not beaten for 3
intervals. A rank that exits cleanly sets its counter to -1 so it is not reported. Counters, not timestamps:
hosts' clocks need not agree.

The watcher reads time from an injectable `clock` (default `time.monotonic`), and `tick()` is one interval's work
done synchronously: the tests drive both on a fake clock, without the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

_PREFIX = "titan_dmuon/heartbeat/"
MISSED_BEATS = 3  # a rank is reported after this many intervals without a beat


class Heartbeat:
    """Beat (every rank) and watch (ranks 0 and world-1) in one daemon thread: `start()` on every rank before a
    collective (after it every rank's key exists), `watch(hosts)` after it."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.rank, self.interval, self.clock = store, rank, interval, clock
        self.watcher = world_size > 1 and rank in (0, world_size - 1)
        self.hosts: list[str] = []  # set by watch(); the watchers watch from then on
        self._keys = [f"{_PREFIX}{r}" for r in range(world_size)]
        self._last: list[tuple[int, float]] = []  # per rank: (counter, `clock()` time it last changed)
        self._reported: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan_dmuon-heartbeat", daemon=True)

    def start(self, thread: bool = True) -> None:
        """The first beat now (so every key exists once the ranks have met in a collective), then the thread;
        `thread=False` starts none: the caller calls `tick()` every interval itself."""
        self.beat()
        if thread:
            self._thread.start()

    def beat(self) -> None:
        """Add 1 to this rank's counter."""
        self.store.add(self._keys[self.rank], 1)

    def tick(self) -> None:
        """One interval's work, as the thread does it: beat, then (a watcher, once watching) read every counter and
        report the ranks silent for MISSED_BEATS intervals."""
        self.beat()
        if self.watcher and self.hosts:
            self._watch()

    def watch(self, hosts: Sequence[str]) -> None:
        """Start watching (watcher ranks only), naming ranks with these hosts; call after a collective that
        followed every rank's start()."""
        self.hosts = list(hosts)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # the store went away (the job is ending): stop quietly
                return

    def _watch(self) -> None:
        now = self.clock()
        counts = [int(v) for v in self.store.multi_get(self._keys)]
        if not self._last:
            self._last = [(c, now) for c in counts]
            return
        for r, (count, (before, since)) in enumerate(zip(counts, self._last, strict=True)):
            if count != before:
                self._last[r] = (count, now)
                self._reported.discard(r)
            elif count >= 0 and r not in self._reported and now - since >= MISSED_BEATS * self.interval:
                self._reported.add(r)
                logger.warning(
                    "rank %d on host %s: no heartbeat for %.1f s (dead, stopped or hung)", r, self.hosts[r], now - since
                )

    def silent_ranks(self) -> list[tuple[int, str, float]]:
        """(rank, host, seconds since its last beat) of every rank this watcher has reported; empty elsewhere."""
        now = self.clock()
        return [(r, self.hosts[r], now - self._last[r][1]) for r in sorted(self._reported)]

    def stop(self, clean: bool) -> None:
        """Stop beating; clean=True (a normal exit) also tells the watchers not to report this rank."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 1.0)
        if clean:
            try:
                self.store.set(self._keys[self.rank], "-1")
            except Exception:
                pass
