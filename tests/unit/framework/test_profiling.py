import json

import torch

from titan_dmuon.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_dmuon.config import Profiling


def run_steps(prof, first, last):
    for step in range(first, last + 1):
        with torch.profiler.record_function(f"train_step_{step}"):
            torch.mm(torch.randn(4, 4), torch.randn(4, 4))
        prof.step()


def recorded_steps(path):
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if str(e.get("name", "")).startswith("train_step_"))


def test_trace_written_every_profile_freq_steps(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=3, save_traces_folder="traces")
    with maybe_enable_profiling(cfg, str(tmp_path), global_step=0, rank=0) as prof:
        run_steps(prof, 1, 7)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert written == ["traces/iteration_3/rank0_trace.json", "traces/iteration_6/rank0_trace.json"]
    # each trace holds exactly the step it is named after
    assert recorded_steps(tmp_path / "traces/iteration_3/rank0_trace.json") == ["train_step_3"]
    assert recorded_steps(tmp_path / "traces/iteration_6/rank0_trace.json") == ["train_step_6"]


def test_resumed_run_keeps_absolute_steps(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=3)
    with maybe_enable_profiling(cfg, str(tmp_path), global_step=4, rank=2) as prof:
        run_steps(prof, 5, 6)
    trace = tmp_path / "profile_traces/iteration_6/rank2_trace.json"
    assert [p for p in tmp_path.rglob("*.json")] == [trace]
    assert recorded_steps(trace) == ["train_step_6"]


def test_disabled_is_a_noop(tmp_path):
    with maybe_enable_profiling(Profiling(enable_profiling=False, profile_freq=1), str(tmp_path)) as prof:
        prof.step()
    with maybe_enable_memory_snapshot(Profiling(enable_memory_snapshot=False, profile_freq=1), str(tmp_path)) as snap:
        snap.step()
        snap.step(exit_ctx=True)
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshot_where_cuda_is(tmp_path):
    """Enabled: with CUDA a snapshot every profile_freq steps and one at exit; without CUDA (no recorder)
    a no-op that writes nothing."""
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=2, save_memory_snapshot_folder="snaps")
    with maybe_enable_memory_snapshot(cfg, str(tmp_path), global_step=0, rank=1) as snap:
        for _ in range(3):
            snap.step()
        snap.step(exit_ctx=True)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    if torch.cuda.is_available():
        assert written == [
            "snaps/iteration_2/rank1_memory_snapshot.pickle",
            "snaps/iteration_3_exit/rank1_memory_snapshot.pickle",
        ]
    else:
        assert written == []
