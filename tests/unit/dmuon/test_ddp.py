"""The DDP paths on one rank (titan_dmuon.dmuon.ddp, api): torch's DistributedDataParallel around a model after
dedicate_params_ddp (DDP ignores the dedicated params; dmuon.Muon, no_sync, clip and the state dicts take the
wrapper), and the checks of dmuon.replicate / replicate_tp. Multi-rank parity: tests/distributed/
test_dmuon_hsdp_ddp.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from tests.tiny_models import proj_predicate
from tests.unit.dmuon.helpers import DEDICATED, mesh1, tiny, torch_ddp, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.state import state_of


def test_dedicated_params_are_marked_for_torch_ddp_to_ignore(one_rank):
    model = tiny()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["head.weight"])  # the user's own
    wrapped = torch_ddp(model)
    assert sorted(model._ddp_params_and_buffers_to_ignore) == sorted(["head.weight", *DEDICATED])
    assert wrapped.parameters_to_ignore == {"head.weight", *DEDICATED}
    left = {id(p) for p in wrapped._module_parameters}
    assert all(id(model.get_parameter(n)) not in left for n in DEDICATED)


def test_muon_step_through_the_wrapper_equals_the_unwrapped_step(one_rank):
    """dmuon.Muon(DDP(model)) is dmuon.Muon(model): same groups, and on one rank bitwise the same steps."""
    results = []
    for wrap in (False, True):
        model = tiny()
        dmuon.dedicate_params_ddp(model, mesh1("dp"), proj_predicate)
        run = DistributedDataParallel(model) if wrap else model
        opt = dmuon.Muon(run, lr=0.05, adamw_lr=1e-2)
        assert opt.model is model
        assert sorted(g["kind"] for g in opt.param_groups) == ["adamw", "muon"]
        for step in range(2):
            run(x(step)).backward()
            norm = dmuon.clip_grad_norm_(run, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
        results.append((norm, dmuon.get_model_state_dict(run), dmuon.get_optimizer_state_dict(run, opt)))
    (n0, sd0, osd0), (n1, sd1, osd1) = results
    assert torch.equal(n0, n1)
    assert list(sd1) == list(tiny().state_dict())  # no "module." prefix
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert osd0["param_groups"] == osd1["param_groups"]
    assert set(osd1["state"]) == set(sd1)


def test_dmuon_no_sync_enters_ddps_own(one_rank):
    wrapped = torch_ddp(tiny())
    st = state_of(wrapped, "test")
    with dmuon.no_sync(wrapped):
        assert not wrapped.require_backward_grad_sync and not st.sync_grads
        wrapped(x()).backward()
    assert wrapped.require_backward_grad_sync and st.sync_grads
    assert all(dp._reduced_grad is None and dp.param.grad is not None for dp in st.dparams)
    with wrapped.no_sync():  # DDP's own alone leaves DMuon's reduce on (still right, see the distributed test)
        assert st.sync_grads


def test_dmuon_no_sync_turns_off_replicate(one_rank):
    from titan_dmuon.dmuon.ddp import replicate_no_sync

    model = tiny()
    dmuon.dedicate_params_ddp(model, mesh1("dp"), proj_predicate)
    dmuon.replicate(model, mesh1("dp"))
    sync = model._dmuon_replicate
    with dmuon.no_sync(model):
        assert not sync.sync_grads
        with replicate_no_sync(model):
            assert not sync.sync_grads
        assert not sync.sync_grads
    assert sync.sync_grads
    with pytest.raises(RuntimeError, match="replicate was already called"):
        dmuon.replicate(model, mesh1("dp"))


def test_muon_without_dedicated_params_says_so_through_the_wrapper(one_rank):
    with pytest.raises(RuntimeError, match=r"^dmuon.Muon: the model has no dedicated params.*before dmuon"):
        dmuon.Muon(DistributedDataParallel(tiny()))


def _tp_model(tp_name: str):
    """A tiny model whose first gate_proj is TP-parallelized (Colwise) on a 1-rank mesh named `tp_name`."""
    model = tiny()
    parallelize_module(model.layers[0], mesh1(tp_name), {"gate_proj": ColwiseParallel()})
    return model


def test_replicate_refuses_dtensors(one_rank):
    with pytest.raises(ValueError, match=r"'layers\.0\.gate_proj\.weight' is a DTensor.*replicate_tp"):
        dmuon.replicate(_tp_model("tp"), mesh1("dp"))


def test_replicate_tp_checks_the_dp_slice(one_rank):
    with pytest.raises(ValueError, match="DP mesh has no dim name"):
        dmuon.replicate_tp(_tp_model("tp"), mesh1())
    with pytest.raises(ValueError, match=r"DTensor on a mesh with the DP dim 'dp'"):
        dmuon.replicate_tp(_tp_model("dp"), mesh1("dp"))
    model = _tp_model("tp")
    assert dmuon.replicate_tp(model, mesh1("dp")) is model
