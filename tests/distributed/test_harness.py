"""The multi-rank harness itself: a hung rank fails the test in bounded time, with every live rank's stack."""

from __future__ import annotations

import time

import pytest

from tests._dist import run_distributed


def _rank1_hangs(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)  # never joins the barrier: rank 0 waits in it
    dist.barrier()


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


@pytest.mark.slow
def test_hung_rank_times_out_with_every_stack():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_hangs, 2, timeout=8)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "timed out after 8 s" in msg
    assert "---- rank 0 (still running) ----" in msg and "---- rank 1 (still running) ----" in msg
    assert "_rank1_hangs" in msg  # a real Python stack of the test function, from the ranks themselves
    assert elapsed < 30, elapsed


@pytest.mark.slow
def test_failing_rank_reports_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_raises, 2, timeout=60)
    assert "boom on rank 1" in str(info.value)
