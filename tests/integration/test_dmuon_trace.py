"""A profiler trace of a DMuon training step names every DMuon phase (titan_dmuon/dmuon/trace.py), and the trainer
logs the optimizer step's share of the step time (`time/optimizer_share`).

One train.py run of the tinymodel on 4 ranks, dp_replicate 2 x tp 2 (shard axis of 1): the replicate axis gives the
post-step publish, the TP axis the gather -> NS -> scatter of every Muon matrix (the tinymodel's are all TP-sharded),
and the shard axis of 1 still packs each group's buffer (its broadcast, over one rank, sends nothing) and reduces
(stage 1 over one rank, stage 2 over the replicate axis). dp_shard 2 x tp 2 would have no publish. QK-clip is on
(`qk_clip_tau`). The profiler records step STEPS, the last one; its chrome traces are read per rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train_runs import read_scalars, run_train, tail, tiny_train_argv

STEPS = 3  # the profiler warms up on steps 1-2 and records step 3
LAYOUT = (
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--parallelism.tensor_parallel_degree",
    "2",
)


def trace_names(path: Path) -> set[str]:
    """The names of the events of a chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name") for e in events}


@pytest.mark.slow
def test_trace_names_dmuon_phases(tmp_path) -> None:
    from titan_dmuon.dmuon import trace

    dump = tmp_path / "run"
    argv = tiny_train_argv(
        dump,
        *LAYOUT,
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        str(STEPS),
        "--optimizer.muon.qk_clip_tau",
        "0.5",
        tensorboard=True,
    )
    proc = run_train(4, argv)
    assert proc.returncode == 0, tail(proc)

    folder = dump / "profile_traces" / f"iteration_{STEPS}"
    names = {rank: trace_names(folder / f"rank{rank}_trace.json") for rank in range(4)}
    # Every rank packs and waits for its groups' broadcasts, reduces its grads, gathers and scatters the TP shards of
    # the matrices its replica owns and publishes them (the previous step's deferred TP tail runs in this step's
    # forward). Newton-Schulz runs on TP owners only and QK-clip on the ranks that update q/k rows (here every rank is
    # one of those, but that is the partitioner's choice): some rank has each.
    everywhere = {trace.PACK, trace.BROADCAST_WAIT, trace.REDUCE, trace.PUBLISH, trace.TP_GATHER, trace.TP_SCATTER}
    for rank, found in names.items():
        assert everywhere <= found, f"rank {rank} lacks {sorted(everywhere - found)}"
    seen = set().union(*names.values())
    assert set(trace.PHASES) <= seen, f"no rank has {sorted(set(trace.PHASES) - seen)}"

    share = read_scalars(dump / "tb")["time/optimizer_share"]
    assert sorted(share) == list(range(1, STEPS + 1))
    assert all(0 < v < 1 for v in share.values()), share
