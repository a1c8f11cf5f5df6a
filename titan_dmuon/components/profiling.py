"""torch.profiler traces and CUDA memory snapshots on a step interval.

Both context managers yield an object whose `.step()` the training loop calls once after every
training step; disabled, they yield a no-op with the same interface, so the loop has no branches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titan_dmuon.config import Profiling as ProfilingConfig

logger = logging.getLogger(__name__)

_WARMUP_STEPS = 3  # profiler warmup before the recorded step; skipped when profile_freq is smaller
_MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000


class _NoOp:
    def step(self, exit_ctx: bool = False) -> None:
        pass


def _schedule(profile_freq: int, global_step: int):
    """Record the last step of every profile_freq period, counted in absolute training steps, so a run
    resumed at `global_step` traces the same steps as an uninterrupted one."""
    warmup = min(_WARMUP_STEPS, profile_freq - 1)

    def action(k: int) -> ProfilerAction:
        pos = (global_step + k) % profile_freq  # profiler step k runs training step global_step + k + 1
        if pos == profile_freq - 1:
            return ProfilerAction.RECORD_AND_SAVE
        if pos >= profile_freq - 1 - warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    return action


@contextlib.contextmanager
def maybe_enable_profiling(
    cfg: ProfilingConfig, dump_folder: str, global_step: int = 0, rank: int = 0
) -> Iterator[object]:
    """Yields a torch.profiler.profile writing <dump_folder>/<save_traces_folder>/iteration_<step>/
    rank<rank>_trace.json for every training step divisible by profile_freq (or a no-op)."""
    if not cfg.enable_profiling:
        yield _NoOp()
        return
    trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        step_dir = os.path.join(trace_dir, f"iteration_{global_step + prof.step_num}")
        os.makedirs(step_dir, exist_ok=True)
        path = os.path.join(step_dir, f"rank{rank}_trace.json")
        prof.export_chrome_trace(path)
        logger.info("profiler trace written to %s", path)

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    logger.info("profiling every %d steps into %s", cfg.profile_freq, trace_dir)
    with torch.profiler.profile(
        activities=activities,
        schedule=_schedule(cfg.profile_freq, global_step),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        yield prof


class _MemorySnapshotter:
    """Dumps the CUDA allocator history every `freq` steps (and on demand at exit, e.g. after an OOM)."""

    def __init__(self, folder: str, freq: int, global_step: int, rank: int) -> None:
        self.folder, self.freq, self.step_num, self.rank = folder, freq, global_step, rank
        torch.cuda.memory._record_memory_history(max_entries=_MEMORY_SNAPSHOT_MAX_ENTRIES)

    def step(self, exit_ctx: bool = False) -> None:
        """Call after each training step; exit_ctx=True dumps now into iteration_<step>_exit."""
        if not exit_ctx:
            self.step_num += 1
            if self.step_num % self.freq != 0:
                return
        name = f"iteration_{self.step_num}" + ("_exit" if exit_ctx else "")
        step_dir = os.path.join(self.folder, name)
        os.makedirs(step_dir, exist_ok=True)
        path = os.path.join(step_dir, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("memory snapshot written to %s", path)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    cfg: ProfilingConfig, dump_folder: str, global_step: int = 0, rank: int = 0
) -> Iterator[object]:
    """Records CUDA memory history when enabled and CUDA is there (the CPU build has no recorder);
    snapshots go to <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle."""
    if not cfg.enable_memory_snapshot:
        yield _NoOp()
        return
    if not torch.cuda.is_available():
        logger.warning("profiling.enable_memory_snapshot needs CUDA; no memory snapshot on this machine")
        yield _NoOp()
        return
    snapshotter = _MemorySnapshotter(
        os.path.join(dump_folder, cfg.save_memory_snapshot_folder), cfg.profile_freq, global_step, rank
    )
    try:
        yield snapshotter
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
