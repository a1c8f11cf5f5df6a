"""One-process tests of the multi-node pieces: replicate = "nodes", the mesh groups on nodes and their description,
the node-layout check, which errors count as a dead or hung peer, the heartbeat watcher, the collective timeout."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_dmuon.config import ConfigError, JobConfig, validate_config
from titan_dmuon.parallel import ParallelDims
from titan_dmuon.parallel.failures import CommFailureError, comm_failure_kind, comm_failures, describe_comm_failure
from titan_dmuon.parallel.heartbeat import Heartbeat
from titan_dmuon.parallel.layout import RankPlace, check_node_layout, describe_layout, node_names
from titan_dmuon.parallel.runtime import set_collective_timeout


def _dims(cfg_replicate, world: int, per_node: int | None, shard: int = -1, tp: int = 1) -> ParallelDims:
    cfg = JobConfig()
    p = cfg.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree = cfg_replicate, shard, tp
    validate_config(cfg)
    return ParallelDims.from_config(cfg, world, per_node)


def test_replicate_nodes_is_one_replica_per_node() -> None:
    d = _dims("nodes", 16, 8)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 8, 1)
    d = _dims("nodes", 64, 8, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (8, 4, 2)
    assert _dims("nodes", 4, 4).dp_replicate == 1  # one node: no replication
    with pytest.raises(ConfigError, match=r"needs the ranks per node"):
        _dims("nodes", 16, None)
    with pytest.raises(ConfigError, match=r"world size 12 is not a whole number of nodes of 8 ranks"):
        _dims("nodes", 12, 8)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree = the ranks per node \(8\), got 2 x 2"):
        _dims("nodes", 16, 8, shard=2, tp=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree \(3\) does not divide the 8 ranks per node"):
        _dims("nodes", 16, 8, tp=3)
    with pytest.raises(ConfigError, match=r'must be >= 1 or "nodes", got 0'):
        _dims(0, 4, 4)


def test_mesh_groups_are_row_major() -> None:
    d = ParallelDims(2, 2, 2, 8)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_torchrun_numbering_puts_shard_groups_inside_nodes() -> None:
    """2 nodes x 4 ranks numbered per node (torchrun): shard x tp = 4 fills a node, replicate spans both."""
    places = [RankPlace(f"gpu-{r // 4}", r // 4, r % 4) for r in range(8)]
    d = ParallelDims(2, 2, 2, 8)
    check_node_layout(d, places)
    text = describe_layout(d, node_names(places))
    assert text.splitlines() == [
        "Layout: 8 ranks on 2 node(s) of 4 ranks; mesh (replicate, shard, tp) = (2, 2, 2), row-major",
        "  nodes: gpu-0 = ranks 0-3; gpu-1 = ranks 4-7",
        "  shard groups: 4 x 2 ranks, each inside one node: [0, 2] on gpu-0; [1, 3] on gpu-0; [4, 6] on gpu-1; "
        "... (1 more)",
        "  replicate groups: 4 x 2 ranks, each across 2 nodes, one rank on each: [0, 4] on gpu-0, gpu-1; [1, 5] on "
        "gpu-0, gpu-1; [2, 6] on gpu-0, gpu-1; ... (1 more)",
        "  tp groups: 4 x 2 ranks, each inside one node: [0-1] on gpu-0; [2-3] on gpu-0; [4-5] on gpu-1; ... (1 more)",
    ]
    # ranks dealt round-robin over the nodes (another launcher's numbering): a shard group crosses nodes
    cyclic = [RankPlace(f"gpu-{r % 2}", r % 2, r // 2) for r in range(8)]
    with pytest.raises(ConfigError, match=r"tp group of ranks 0-1 spans nodes gpu-0, gpu-1"):
        check_node_layout(d, cyclic)


def test_node_names_tell_agents_on_one_host_apart() -> None:
    places = [RankPlace("box", r // 2, r % 2) for r in range(4)]
    assert node_names(places) == ["box#0", "box#0", "box#1", "box#1"]
    check_node_layout(ParallelDims(2, 2, 1, 4), places)
    with pytest.raises(ConfigError, match=r"replicate group of ranks 0, 2 has two ranks on one node"):
        check_node_layout(ParallelDims(2, 2, 1, 4), [RankPlace("box", -1, r) for r in range(4)])


def test_describe_layout_stays_short_for_big_jobs() -> None:
    d = ParallelDims(4, 32, 8, 1024)
    text = describe_layout(d, [f"n{g // 8:03d}" for g in range(1024)])
    assert len(text.splitlines()) == 5 and len(text) < 1200
    assert "replicate groups: 256 x 4 ranks, each across 4 nodes, one rank on each: [0, 256, 512, 768] on n000" in text
    assert "shard groups: 32 x 32 ranks, each across 32 nodes, one rank on each: [0, 8, ..., 248 (stride 8)]" in text


def test_which_errors_are_a_dead_or_hung_peer() -> None:
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/"
    timeout = RuntimeError(gloo + "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")
    closed = RuntimeError(gloo + "pair.cc:537] Read error [10.0.0.2]:47298: Connection reset by peer.")
    assert comm_failure_kind(timeout) == "timeout"
    assert comm_failure_kind(closed) == "lost peer"
    assert comm_failure_kind(dist.DistNetworkError("Connection closed by peer")) == "lost peer"
    assert comm_failure_kind(RuntimeError("shape mismatch: timed out of patience")) is None  # not a gloo error
    assert comm_failure_kind(ValueError("x")) is None
    wrapped = RuntimeError("while reducing")
    wrapped.__cause__ = timeout
    assert comm_failure_kind(wrapped) == "timeout"

    message = describe_comm_failure(timeout, 0, "node0", 10.0, [(3, "node1", 9.4)])
    assert message.startswith("rank 0 on host node0: collective timed out after 10 s (a peer is dead or hung); ")
    assert "silent peers: rank 3 on host node1 (no heartbeat for 9 s)" in message
    assert describe_comm_failure(ValueError("x"), 0, "h", 1.0, []) is None

    with pytest.raises(CommFailureError, match=r"rank 1 on host h: a peer's connection closed"):
        with comm_failures(lambda e: describe_comm_failure(e, 1, "h", 5.0, [])):
            raise closed
    with pytest.raises(ValueError):
        with comm_failures(lambda e: describe_comm_failure(e, 1, "h", 5.0, [])):
            raise ValueError("not ours")


class FakeClock:
    """A clock the test moves by hand: `Heartbeat(clock=...)`."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


HOSTS = ["node0", "node0", "node1", "node1"]


def _fake_clock_beats(interval: float = 1.0) -> tuple[FakeClock, list[Heartbeat]]:
    """4 ranks on one store and a fake clock, started without their threads, watching."""
    store, clock = dist.HashStore(), FakeClock()
    beats = [Heartbeat(store, r, len(HOSTS), interval=interval, clock=clock) for r in range(4)]
    for b in beats:
        b.start(thread=False)
    for b in beats:
        b.watch(HOSTS)
    return clock, beats


def _interval(clock: FakeClock, beats: list[Heartbeat], alive: list[int]) -> None:
    """One interval later, the `alive` ranks tick: the non-watchers first, so the watchers see this interval's beats."""
    clock.now += beats[0].interval
    for r in sorted(alive, key=lambda r: beats[r].watcher):
        beats[r].tick()


def test_heartbeat_watcher_names_a_silent_rank_but_not_one_that_exited_cleanly(caplog) -> None:
    clock, beats = _fake_clock_beats()
    assert [b.watcher for b in beats] == [True, False, False, True]
    with caplog.at_level(logging.WARNING, logger="titan_dmuon.parallel.heartbeat"):
        for _ in range(3):
            _interval(clock, beats, [0, 1, 2, 3])
        beats[1].stop(clean=True)  # finished
        beats[2].stop(clean=False)  # died: it beats no more
        for _ in range(2):  # 2 intervals without a beat: not yet reported
            _interval(clock, beats, [0, 3])
        assert beats[0].silent_ranks() == beats[3].silent_ranks() == [] and caplog.text == ""
        _interval(clock, beats, [0, 3])  # the 3rd (MISSED_BEATS): reported, by both watchers
        assert beats[0].silent_ranks() == beats[3].silent_ranks() == [(2, "node1", 3.0)]
        assert caplog.text.count("rank 2 on host node1: no heartbeat for 3.0 s (dead, stopped or hung)") == 2
        for _ in range(3):  # reported once; the silence grows
            _interval(clock, beats, [0, 3])
        assert beats[0].silent_ranks() == [(2, "node1", 6.0)]
        assert caplog.text.count("rank 2 on host node1") == 2 and "rank 1 " not in caplog.text
    assert beats[1].silent_ranks() == []  # not a watcher


def test_heartbeat_a_rank_that_beats_again_is_no_longer_silent(caplog) -> None:
    clock, beats = _fake_clock_beats(interval=0.5)
    _interval(clock, beats, [0, 1, 2, 3])
    for _ in range(4):  # rank 1 stopped (SIGSTOP) for 4 intervals of 0.5 s: reported after 1.5 s
        _interval(clock, beats, [0, 2, 3])
    assert beats[0].silent_ranks() == [(1, "node0", 2.0)]
    _interval(clock, beats, [0, 1, 2, 3])  # resumed
    assert beats[0].silent_ranks() == beats[3].silent_ranks() == []
    with caplog.at_level(logging.WARNING, logger="titan_dmuon.parallel.heartbeat"):
        for _ in range(3):  # silent again: reported again
            _interval(clock, beats, [0, 2, 3])
    assert beats[3].silent_ranks() == [(1, "node0", 1.5)] and "rank 1 on host node0" in caplog.text


def test_heartbeat_threads_report_a_dead_rank() -> None:
    """The real daemon threads: a rank that stops beating is named by both watchers (bounded by a generous
    deadline, not by the interval: a busy machine only delays the report)."""
    store = dist.HashStore()
    beats = [Heartbeat(store, r, len(HOSTS), interval=0.05) for r in range(4)]
    for b in beats:
        b.start()
    for b in beats:
        b.watch(HOSTS)
    try:
        beats[1].stop(clean=True)  # finished
        beats[2].stop(clean=False)  # died
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(2 in [r for r, _, _ in beats[w].silent_ranks()] for w in (0, 3)):
            time.sleep(0.05)
        for w in (0, 3):  # a live rank starved of CPU for 3 intervals may show up too; the clean exit never does
            silent = beats[w].silent_ranks()
            assert (2, "node1") in [(r, h) for r, h, _ in silent] and 1 not in [r for r, _, _ in silent]
    finally:
        for b in (beats[0], beats[3]):
            b.stop(clean=True)


def test_set_collective_timeout_reaches_every_group() -> None:
    """On a 1-rank gloo group and a subgroup: the timeout each gloo backend uses is the one set."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=300))
    try:
        sub = dist.new_group([0])
        set_collective_timeout(7)
        for group in (dist.group.WORLD, sub):
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
