"""The planner's FSDP2 / TP shard arithmetic (titan_dmuon/planner/memory.py `local_numel`) against torch.chunk on real
tensors: TP cuts its dim first, then FSDP2 cuts dim 0 of the TP shard, uneven sizes included (a 258-row vocabulary
over TP 4 and 4 shard ranks: TP shards of 65, 65, 65, 63 rows, FSDP2 shards of 17, 17, 17, 14 and 16, 16, 16, 15
rows, as a fake-process-group build's `to_local()` shapes are)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from titan_dmuon.parallel import ParallelDims
from titan_dmuon.planner.memory import local_numel


@pytest.mark.parametrize("shape,tp_dim", [((258, 256), 0), ((256, 258), 1), ((10, 3), 0), ((5,), None)])
@pytest.mark.parametrize("R,N,T", [(1, 4, 4), (2, 3, 2), (1, 8, 1)])
def test_local_numel_is_torch_chunk_of_the_tp_shard(shape, tp_dim, R, N, T) -> None:
    dims = ParallelDims(dp_replicate=R, dp_shard=N, tp=T, world_size=R * N * T)
    coords = dims.coordinates()
    tp = Shard(tp_dim) if tp_dim is not None else Replicate()
    # HSDP's replicate axis keeps the tensor whole; FSDP2 shards dim 0 on "shard" (a strided shard under TP dim 0)
    got = local_numel(shape, ("replicate", "shard", "tp"), (R, N, T), (Replicate(), Shard(0), tp), coords)
    full = torch.empty(shape)
    for g in range(dims.world_size):
        local = full if tp_dim is None else full.chunk(T, dim=tp_dim)[coords["tp"][g]]
        chunks = local.chunk(N, dim=0)
        s = int(coords["shard"][g])
        want = chunks[s].numel() if s < len(chunks) else 0  # torch.chunk returns fewer chunks when rows run out
        assert got[g] == want, (g, shape, R, N, T)
