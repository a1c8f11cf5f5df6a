"""`dmuon.get_owned_params` on a (dp, tp) mesh whose dedicated matrices are not TP-sharded (here: none is a
DTensor): the TP coordinate comes from the mesh, so every rank names the right owner of each matrix in each
DP slice (with the coordinate read off the params, every rank said TP 0 and the slices collapsed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import rank_device, run_distributed
from tests.tiny_models import TinyMLP, proj_predicate


def _owned(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyMLP(16, 32, 4).to(device)
    dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
    mine = sorted(dp.fqn for dp in model._dmuon_state.dparams if dp.is_owner)
    return dict(
        mine=mine,
        answers={r: sorted(dp.fqn for dp in dmuon.get_owned_params(model, r)) for r in range(dist.get_world_size())},
    )


@pytest.mark.slow
def test_get_owned_params_under_tp_without_tp_sharded_dedicated_params():
    results = run_distributed(_owned, 4)
    for asker, r in enumerate(results):
        for rank, owned in r["answers"].items():
            assert owned == results[rank]["mine"], f"rank {asker} on rank {rank}: {owned} != {results[rank]['mine']}"
    assert all(r["mine"] for r in results), "4 matrix units over 2 DP ranks: every rank owns some"
