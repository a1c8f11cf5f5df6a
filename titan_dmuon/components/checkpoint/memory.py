"""What a checkpoint save or load costs in host memory: each rank's row (RSS before, peak RSS after, its share of the
state), and the ranks' rows of one save or load as one record and one log line, whatever the job's size. The
manager (manager.py) keeps every row of its rank in `CheckpointManager.memory`; rank 0 logs the line (INFO) and the
record (DEBUG)."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor


def local_bytes(sd: dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict: a DTensor counts its local shard."""
    total = 0
    for v in flatten_state_dict(sd)[0].values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS so far) of this process in MiB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return current / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_row(what: str, step: int, rank: int, rss_before: float, peak_before: float, share: int) -> dict[str, Any]:
    """This rank's row of one save or load: `rss_before`/`peak_before` (MiB, `rss_mib()` before it), the peak and
    RSS now, and `share` (bytes: its part of the state, `local_bytes`)."""
    rss, peak = rss_mib()
    return {
        "what": what,
        "step": step,
        "rank": rank,
        "rss_before_mib": round(rss_before, 1),
        "peak_before_mib": round(peak_before, 1),
        "peak_after_mib": round(peak, 1),
        "rss_after_mib": round(rss, 1),
        "state_share_mib": round(share / 2**20, 3),
    }


def memory_summary(rows: list[dict]) -> dict:
    """The ranks' memory rows of one save or load as one record: [min, median, max] over the ranks of each figure,
    the growth of each rank's peak over what it held before, and the largest growth beyond the rank's own share of
    the state (what a save or load should cost at most)."""

    def spread(values: list[float]) -> list[float]:
        v = sorted(values)
        return [round(v[0], 1), round(v[len(v) // 2], 1), round(v[-1], 1)]

    growth = [r["peak_after_mib"] - max(r["peak_before_mib"], r["rss_before_mib"]) for r in rows]
    beyond = [g - r["state_share_mib"] for g, r in zip(growth, rows, strict=True)]
    worst = max(range(len(rows)), key=beyond.__getitem__)
    return {
        "what": rows[0]["what"],
        "step": rows[0]["step"],
        "ranks": len(rows),
        "rss_before_mib": spread([r["rss_before_mib"] for r in rows]),
        "peak_after_mib": spread([r["peak_after_mib"] for r in rows]),
        "peak_growth_mib": spread(growth),
        "state_share_mib": spread([r["state_share_mib"] for r in rows]),
        "growth_beyond_share_mib": {"max": round(beyond[worst], 1), "rank": rows[worst]["rank"]},
    }


def memory_line(summary: dict, gathered: bool) -> str:
    """`memory_summary`'s record as the sentence rank 0's log shows (the record itself goes to DEBUG)."""

    def span(v: list[float]) -> str:
        return f"{v[0]:.1f}" if v[0] == v[-1] else f"{v[0]:.1f}-{v[-1]:.1f}"

    n = summary["ranks"]
    who = (f"{n} ranks" if n > 1 else "1 rank") if gathered else "rank 0's figures"
    growth, beyond = summary["peak_growth_mib"][-1], summary["growth_beyond_share_mib"]
    if beyond["max"] > 0:
        share = f"rank {beyond['rank']} grew {beyond['max']:.1f} MiB beyond its state share"
    else:
        share = "within each rank's state share"
    return (
        f"checkpoint {summary['what']} of step {summary['step']} ({who}): peak memory +{growth:.1f} MiB at most, "
        f"{share} ({span(summary['state_share_mib'])} MiB); RSS {span(summary['rss_before_mib'])} MiB before"
    )


__all__ = ["local_bytes", "memory_line", "memory_row", "memory_summary", "rss_mib"]
