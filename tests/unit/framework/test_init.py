"""Topology-invariant init (titan_dmuon/components/initialization.py): any part of a parameter
filled on its own equals that part of the whole parameter filled at once, and a rank's FSDP2 / TP / FSDP-over-TP
(strided) shard is told which global rows and columns it holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import titan_dmuon.components.initialization as init
from titan_dmuon.components.initialization import constant, fill_, full_index, normal, trunc_normal, uniform

INITS = [normal(0.5), trunc_normal(0.02), trunc_normal(1.0, a=-1.5, b=0.5), uniform(-0.3, 0.1)]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(init, "TILE", (4, 8))  # 10 x 21 spans 3 x 3 tiles


def _whole(shape, spec, seed=3, fqn="w"):
    return fill_(torch.empty(shape), spec, seed, fqn, shape, full_index(shape))


@pytest.mark.parametrize("spec", INITS, ids=["normal", "trunc", "trunc-ab", "uniform"])
def test_a_part_equals_that_part_of_the_whole(spec):
    shape = (10, 21)
    whole = _whole(shape, spec)
    parts = [
        ([torch.arange(3, 7), torch.arange(21)], "rows inside one tile pair"),
        ([torch.arange(10), torch.arange(5, 19)], "a column block across tiles"),
        ([torch.tensor([1, 2, 6, 7, 8]), torch.arange(2, 9)], "strided rows"),
        ([torch.arange(9, 10), torch.tensor([0, 20])], "an edge"),
    ]
    for index, what in parts:
        out = torch.empty(len(index[0]), len(index[1]))
        fill_(out, spec, 3, "w", shape, index)
        assert torch.equal(out, whole[index[0][:, None], index[1][None, :]]), what


def test_1d_and_constant_and_bf16_out():
    vec = _whole((37,), normal())
    part = fill_(torch.empty(10), normal(), 3, "w", (37,), [torch.arange(20, 30)])
    assert torch.equal(part, vec[20:30])
    assert torch.equal(_whole((3, 4), constant(1.0)), torch.ones(3, 4))
    low = fill_(torch.empty(10, 21, dtype=torch.bfloat16), normal(), 3, "w", (10, 21), full_index((10, 21)))
    assert torch.equal(low, _whole((10, 21), normal()).bfloat16())


def test_values_depend_on_seed_fqn_and_position_only():
    a = _whole((10, 21), normal())
    assert torch.equal(a, _whole((10, 21), normal()))
    assert not torch.equal(a, _whole((10, 21), normal(), seed=4))
    assert not torch.equal(a, _whole((10, 21), normal(), fqn="v"))
    assert not torch.equal(a[:4, :8], a[4:8, :8])  # tiles are drawn from different streams
    t = _whole((10, 21), trunc_normal(1.0, a=-1.5, b=0.5))
    assert t.min() >= -1.5 and t.max() <= 0.5


def test_init_params_needs_every_fqn():
    with pytest.raises(KeyError, match="no ParamInit for parameter 'bias'"):
        init.init_params(nn.Linear(3, 2), {"weight": normal()}, seed=0)


EXPECTED = {  # rank -> (colwise rows, rowwise rows, rowwise cols) of a 12 x 8 colwise and an 8 x 12 rowwise weight
    0: (list(range(0, 3)), list(range(0, 4)), list(range(0, 6))),
    1: (list(range(6, 9)), list(range(0, 4)), list(range(6, 12))),
    2: (list(range(3, 6)), list(range(4, 8)), list(range(0, 6))),
    3: (list(range(9, 12)), list(range(4, 8)), list(range(6, 12))),
}


def check_rank(rank: int) -> None:
    """One rank of a fake 2 x 2 (shard, tp) world: FSDP2 over TP gives column-parallel weights _StridedShard(0)
    over Shard(0) and row-parallel ones Shard(0) over Shard(1); the index must be what the local tensor holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_dmuon.components.initialization import global_index

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["shard"])
    model.to_empty(device="cpu")
    col_rows, row_rows, row_cols = EXPECTED[rank]
    colwise, rowwise = global_index(model[0].weight), global_index(model[1].weight)
    assert colwise[0].tolist() == col_rows and colwise[1].tolist() == list(range(8)), (rank, colwise)
    assert rowwise[0].tolist() == row_rows and rowwise[1].tolist() == row_cols, (rank, rowwise)
    assert [len(i) for i in colwise] == list(model[0].weight.to_local().shape)


@pytest.mark.slow
def test_global_index_of_fsdp_over_tp_shards():
    """Each rank in a fresh interpreter: torch caches meshes across process groups within one process."""
    repo = Path(__file__).resolve().parents[3]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"from tests.unit.framework.test_init import check_rank; check_rank({rank})"],
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (1, 2, 3)
    ]
    for rank, proc in zip((1, 2, 3), procs, strict=True):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
