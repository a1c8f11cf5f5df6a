"""Fixtures of the dmuon unit tests: the one process group they need (a single gloo rank over an in-memory
store) and the Triton interpreter for the NS kernels."""

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


@pytest.fixture
def syrk(monkeypatch):
    """The Triton NS kernel module (titan_dmuon/dmuon/kernels/syrk.py) built for the interpreter, so that it runs
    on CPU tensors. Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when that module is imported:
    this sets it (for the test) and imports the module, or re-imports it when it was built without. Skips,
    naming the reason, only where Triton does not import."""
    import importlib

    from titan_dmuon.dmuon import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module, why = kernels.load()
    if module is None:
        pytest.skip(f"the Triton kernels need Triton: {why}")
    if not module.INTERPRETED:
        module = importlib.reload(module)
    assert module.INTERPRETED
    return module
