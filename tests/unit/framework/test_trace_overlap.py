"""scripts/trace_overlap.py on a small synthetic chrome trace whose overlap is known by hand."""

from __future__ import annotations

import json

import pytest

from tests._scripts import load_script

trace_overlap = load_script("trace_overlap")


def _kernel(name: str, stream: int, ts: float, dur: float, device: int = 0) -> dict:
    args = dict(device=device, stream=stream)
    return dict(ph="X", cat="kernel", name=name, pid=device, tid=stream, ts=ts, dur=dur, args=args)


@pytest.fixture
def trace(tmp_path):
    """Device 0: compute on stream 7 over [0, 100) and [150, 250), plus a compute kernel on stream 20 over
    [90, 120) (overlapping stream 7's: counted once); NCCL on stream 20 over [50, 200) (overlapped [50, 120) and
    [150, 200): 120 of 150) and on the compute stream 7 over [300, 350) (never overlapped); two NCCL kernels
    on stream 21 over [160, 190) and [180, 230) (union [160, 230), all of it under compute). Device 1: NCCL
    alone. CPU ops are ignored."""
    events = [
        _kernel("gemm_a", 7, 0, 100),
        _kernel("gemm_b", 7, 150, 100),
        _kernel("pack_copy", 20, 90, 30),
        _kernel("ncclDevKernel_Broadcast_RING_LL", 20, 50, 150),
        _kernel("ncclKernel_Reduce_Sum_f32", 7, 300, 50),
        _kernel("ncclDevKernel_AllReduce", 21, 160, 30),
        _kernel("ncclDevKernel_AllReduce", 21, 180, 50),
        _kernel("ncclDevKernel_Broadcast", 3, 0, 40, device=1),
        dict(ph="X", cat="cpu_op", name="aten::mm", pid=1, tid=1, ts=0, dur=1000),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_overlap_by_hand(trace):
    got = trace_overlap.overlap(trace_overlap.load_kernels(trace))
    d0 = got[0]
    # comm union: [50, 200) + [300, 350) = 200 (stream 21's [160, 230) adds [200, 230): 230 in all)
    assert d0["comm_us"] == pytest.approx(230)
    # overlapped: [50, 120) + [150, 230) = 70 + 80 = 150 (compute union: [0, 120) + [150, 250))
    assert d0["overlapped_us"] == pytest.approx(150)
    assert d0["compute_us"] == pytest.approx(220)
    s20, s7, s21 = d0["streams"][20], d0["streams"][7], d0["streams"][21]
    assert (s20["comm_us"], s20["overlapped_us"], s20["n_comm"], s20["n_compute"]) == (150, 120, 1, 1)
    assert (s7["comm_us"], s7["overlapped_us"], s7["n_compute"]) == (50, 0, 2)
    assert (s21["comm_us"], s21["overlapped_us"], s21["n_comm"]) == (70, 70, 2)
    assert got[1]["comm_us"] == 40 and got[1]["overlapped_us"] == 0


def test_report_lines(trace, tmp_path):
    lines = trace_overlap.report(trace)
    assert "65.2%" in lines[0]  # 150 / 230
    assert any("stream 7" in ln and "also runs 2 compute kernels" in ln for ln in lines)
    one = trace_overlap.report(trace, world_size=1)
    assert all("%" not in ln and "world size 1" in ln for ln in one)  # no misleading figure
    empty = tmp_path / "cpu.json"
    empty.write_text(json.dumps({"traceEvents": [dict(ph="X", cat="cpu_op", name="x", ts=0, dur=1)]}))
    assert "no GPU kernels" in trace_overlap.report(str(empty))[0]


def test_union_and_intersection():
    assert trace_overlap.union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert trace_overlap.intersection([(0, 4), (5, 6)], [(3, 5.5)]) == pytest.approx(1.5)
    assert trace_overlap.intersection([], [(0, 1)]) == 0
