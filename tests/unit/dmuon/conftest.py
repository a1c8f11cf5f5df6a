"""The one process group the dmuon unit tests need: a single gloo rank over an in-memory store."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank():
    """dmuon needs a process group: one gloo rank over a `dist.HashStore()`, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
