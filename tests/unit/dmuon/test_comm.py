"""DMuon's collective helpers with the ledger behind them (titan_dmuon.dmuon.comm, .tp), in one process:
on one gloo rank they are no-ops that record nothing, and on a fake 4-rank group (collectives are no-ops
there, the sizes are real) each op records its (N-1)/N share in the ledger. The ledger's own arithmetic:
test_comm_ledger.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.unit.dmuon.helpers import dedicated, tiny, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.comm import KINDS, CommLedger, broadcast_coalesced, reduce_coalesced
from titan_dmuon.dmuon.tp import all_reduce_gram


@pytest.fixture
def fake_four():
    """A fake 4-rank world: every collective returns at once, group sizes are 4."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("helper", [broadcast_coalesced, reduce_coalesced])
@pytest.mark.parametrize("group", ["world", "none"])
def test_one_rank_moves_nothing(one_rank, helper, group):
    ledger = CommLedger()
    t = torch.arange(6.0)
    work = helper([(t, 0)], dist.group.WORLD if group == "world" else None, ledger, "reduce")
    assert not work.is_pending()
    work.wait()
    assert torch.equal(t, torch.arange(6.0)) and not ledger.current and not ledger.ops


def test_one_rank_step_reports_every_kind_as_zero(one_rank):
    """comm_stats after a real step on one rank: every kind present, nothing moved."""
    _, model = dedicated(tiny())
    opt = dmuon.Muon(model)
    model(x()).backward()
    opt.step()
    stats = dmuon.comm_stats(model)
    assert set(stats) == {"elements", "bytes"}
    assert stats["elements"] == stats["bytes"] == {k: 0.0 for k in KINDS}
    assert {k: v for k, v in opt.last_step_stats.items() if k.startswith(("elements_", "bytes_"))} == {
        f"{what}_{k}": 0.0 for what in ("elements", "bytes") for k in KINDS
    }


def test_fake_four_ranks_record_their_share(fake_four):
    ledger = CommLedger()
    world = dist.group.WORLD
    a, b = torch.zeros(10), torch.zeros(6, dtype=torch.bfloat16)
    broadcast_coalesced([(a, 0), (b, 1)], world, ledger, "broadcast").wait()
    reduce_coalesced([(a, 3)], world, ledger, "replicate_reduce").wait()
    all_reduce_gram(_TPParam(world), ledger, torch.zeros(2, 2))
    assert dict(ledger.current) == {"broadcast": 0.75 * 16, "replicate_reduce": 0.75 * 10, "tp_gram": 2 * 0.75 * 4}
    assert dict(ledger.current_bytes) == {"broadcast": 0.75 * (40 + 12), "replicate_reduce": 30.0, "tp_gram": 24.0}
    assert dict(ledger.ops) == {"broadcast": 2, "replicate_reduce": 1, "tp_gram": 1}
    with pytest.raises(ValueError, match="unknown ledger kind 'all_gather'"):
        broadcast_coalesced([(a, 0)], world, ledger, "all_gather")


class _TPParam:
    """What all_reduce_gram reads of a dedicated param: its TP group."""

    def __init__(self, group):
        self.tp_group = group
