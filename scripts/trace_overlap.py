"""How much of the GPU's communication time runs while compute kernels run, from torch.profiler chrome traces.

A kernel whose name contains "nccl" is communication, any other GPU kernel is compute. Per device of each
trace: comm time = the union of the communication kernels' intervals; overlapped = the part of that union
during which some compute kernel of the same device runs (union of the intersections); the fraction is
overlapped / comm. The same per stream that carries communication, with a note where that stream also runs
compute (a collective on the compute stream serializes with it: it can never overlap).

    python3 scripts/trace_overlap.py /tmp/trace/dmuon_rank*.json            # scripts/bench_step.py --trace
    python3 scripts/trace_overlap.py --world-size 1 /tmp/trace/dmuon_rank0.json

With --world-size 1 the collectives span one rank (copies at most, or nothing): the script then prints the
communication it found but no overlap fraction, which would say nothing about a multi-GPU run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

Interval = tuple[float, float]


@dataclass(frozen=True)
class Kernel:
    device: int
    stream: int
    name: str
    start: float  # microseconds, as in the trace
    end: float

    @property
    def is_comm(self) -> bool:
        return "nccl" in self.name.lower()


def load_kernels(path: str) -> list[Kernel]:
    """The GPU kernels ("cat": "kernel" complete events) of a chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        args = e.get("args", {})
        device = int(args.get("device", e.get("pid", 0)))
        stream = int(args.get("stream", e.get("tid", 0)))
        start = float(e["ts"])
        out.append(Kernel(device, stream, e.get("name", ""), start, start + float(e.get("dur", 0.0))))
    return out


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two unions (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(kernels: list[Kernel]) -> dict[int, dict]:
    """Per device: comm_us, overlapped_us, n_comm, and per comm stream {stream: dict(comm_us, overlapped_us,
    n_comm, n_compute)}."""
    out = {}
    for device in sorted({k.device for k in kernels}):
        mine = [k for k in kernels if k.device == device]
        compute = union([(k.start, k.end) for k in mine if not k.is_comm])
        comm_kernels = [k for k in mine if k.is_comm]
        comm = union([(k.start, k.end) for k in comm_kernels])
        streams = {}
        for stream in sorted({k.stream for k in comm_kernels}):
            on_stream = union([(k.start, k.end) for k in comm_kernels if k.stream == stream])
            streams[stream] = dict(
                comm_us=length(on_stream),
                overlapped_us=intersection(on_stream, compute),
                n_comm=sum(1 for k in comm_kernels if k.stream == stream),
                n_compute=sum(1 for k in mine if k.stream == stream and not k.is_comm),
            )
        out[device] = dict(
            comm_us=length(comm),
            overlapped_us=intersection(comm, compute),
            n_comm=len(comm_kernels),
            compute_us=length(compute),
            streams=streams,
        )
    return out


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "n/a"


def report(path: str, world_size: int = 0) -> list[str]:
    """The printed lines for one trace."""
    kernels = load_kernels(path)
    if not kernels:
        return [f"{path}: no GPU kernels in the trace (a CPU run?): the overlap is measured on CUDA traces only"]
    lines = []
    for device, d in overlap(kernels).items():
        head = (
            f"{path}: device {device}: compute {d['compute_us'] / 1e3:.2f} ms busy; communication "
            f"{d['comm_us'] / 1e3:.2f} ms in {d['n_comm']} NCCL kernels on {len(d['streams'])} stream(s)"
        )
        if world_size == 1:
            lines.append(
                head + "; world size 1: the collectives span one rank (trivial), so no overlap figure is given"
            )
            continue
        if not d["n_comm"]:
            lines.append(head + ": no communication kernels, nothing to overlap")
            continue
        lines.append(
            head + f", {d['overlapped_us'] / 1e3:.2f} ms of it overlapped with compute: "
            f"{_pct(d['overlapped_us'], d['comm_us'])}"
        )
        for stream, s in d["streams"].items():
            note = (
                f"; this stream also runs {s['n_compute']} compute kernels (collectives serialized with them)"
                if s["n_compute"]
                else ""
            )
            lines.append(
                f"  stream {stream}: {s['n_comm']} NCCL kernels, {s['comm_us'] / 1e3:.2f} ms, overlapped "
                f"{s['overlapped_us'] / 1e3:.2f} ms ({_pct(s['overlapped_us'], s['comm_us'])}){note}"
            )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="chrome trace JSON files (torch.profiler export_chrome_trace)")
    p.add_argument("--world-size", type=int, default=0, help="the run's world size (1: print no overlap figure)")
    args = p.parse_args(argv)
    for path in args.traces:
        for line in report(path, args.world_size):
            print(line, flush=True)


if __name__ == "__main__":
    main()
