"""dmuon's state dicts on one rank (titan_dmuon.dmuon.state_dict). Full: keys as a plain `model.state_dict()`
(also through a torch DDP wrapper), a round trip that resumes bitwise, cpu_offload and copies, the setters'
errors. Sharded (DCP): a fresh optimizer's dict is a complete template aliasing live state, a dcp.save/load
round trip resumes bitwise, the setters' errors, the full-only options refused."""

from __future__ import annotations

import pytest
import torch

from tests.unit.dmuon.helpers import DEDICATED, dedicated, tiny, torch_ddp, x
from titan_dmuon import dmuon


def _trained(layout: str, steps: int):
    model = dedicated(tiny())[1] if layout == "fsdp" else torch_ddp(tiny())
    opt = dmuon.Muon(model, lr=0.05, adamw_lr=1e-2)
    for step in range(steps):
        model(x(step)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("layout", ["fsdp", "torch_ddp"])
def test_round_trip_resumes_bitwise(one_rank, layout):
    model, opt = _trained(layout, 2)
    sd, osd = dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt)
    assert list(sd) == list(tiny().state_dict())  # no "module." prefix under DDP
    assert set(osd["state"]) == set(sd) and all(isinstance(g["params"][0], str) for g in osd["param_groups"])
    fresh, fresh_opt = _trained(layout, 0)
    dmuon.set_model_state_dict(fresh, sd)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, osd)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x(2)).backward()
        o.step()
    a, b = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = dmuon.get_optimizer_state_dict(model, opt), dmuon.get_optimizer_state_dict(fresh, fresh_opt)
    for fqn, entry in oa["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][fqn][key])), (fqn, key)


def test_setter_errors(one_rank):
    model, opt = _trained("fsdp", 1)
    sd = dmuon.get_model_state_dict(model)
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\]"):
        dmuon.set_model_state_dict(model, {k: v for k, v in sd.items() if k != "head.weight"})
    with pytest.raises(KeyError, match=r"unexpected keys \['extra'\]"):
        dmuon.set_model_state_dict(model, {**sd, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'layers.0.up_proj.weight' has shape \(3, 3\)"):
        dmuon.set_model_state_dict(model, {**sd, "layers.0.up_proj.weight": torch.zeros(3, 3)})
    osd = dmuon.get_optimizer_state_dict(model, opt)
    with pytest.raises(ValueError, match="the checkpoint has 1 param groups"):
        dmuon.set_optimizer_state_dict(model, opt, {**osd, "param_groups": osd["param_groups"][:1]})
    with pytest.raises(RuntimeError, match="^get_model_state_dict: the model has no dedicated params"):
        dmuon.get_model_state_dict(tiny())


def _fsdp2(model):
    """FSDP2 over one rank for the params DMuon leaves (DTensors on a 1-rank mesh)."""
    from torch.distributed.fsdp import fully_shard

    from tests.unit.dmuon.helpers import mesh1

    for layer in model.layers:
        fully_shard(layer, mesh=mesh1())
    fully_shard(model, mesh=mesh1())
    return model


def test_full_getters_cpu_offload_and_copies(one_rank):
    """cpu_offload gives CPU tensors; every tensor is a copy, also of a DTensor on a 1-rank mesh (whose
    full_tensor() is the live local tensor): a later step leaves the dicts as they were."""
    model = _fsdp2(dedicated(tiny())[1])
    opt = dmuon.Muon(model, lr=0.05, adamw_lr=1e-2)
    model(x(0)).backward()
    opt.step()
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    osd = dmuon.get_optimizer_state_dict(model, opt, rank0_only=True, cpu_offload=True)  # rank 0: everything
    tensors = list(sd.values()) + [v for e in osd["state"].values() for v in e.values()]
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)
    assert set(osd["state"]) == set(sd)
    before = {k: v.clone() for k, v in sd.items()}
    model(x(1)).backward()
    opt.step()
    assert all(torch.equal(sd[k], before[k]) for k in sd)
    assert not torch.equal(dmuon.get_model_state_dict(model)["head.weight"], before["head.weight"])


@pytest.mark.parametrize("layout", ["fsdp2", "torch_ddp"])
def test_sharded_round_trip_through_dcp(one_rank, tmp_path, layout):
    """A fresh optimizer's sharded dict already holds every state tensor (zeros, step 0) and aliases the live
    state; dcp.save after 2 steps, dcp.load into a fresh model: the next step is bitwise the uninterrupted one."""
    import torch.distributed.checkpoint as dcp

    from titan_dmuon.dmuon.state import state_of

    def build():
        model = _fsdp2(dedicated(tiny())[1]) if layout == "fsdp2" else torch_ddp(tiny())
        return model, dmuon.Muon(model, lr=0.05, adamw_lr=1e-2)

    def sharded(model, opt):
        return {
            "model": dmuon.get_model_state_dict(model, full_state_dict=False),
            "optimizer": dmuon.get_optimizer_state_dict(model, opt, full_state_dict=False),
        }

    model, opt = build()
    for step in range(2):
        model(x(step)).backward()
        opt.step()
        opt.zero_grad()
    dcp.save(sharded(model, opt), checkpoint_id=str(tmp_path))
    fresh, fresh_opt = build()
    template = sharded(fresh, fresh_opt)
    names = list(tiny().state_dict())
    assert sorted(template["model"]) == sorted(names) and sorted(template["optimizer"]["state"]) == sorted(names)
    for fqn, entry in template["optimizer"]["state"].items():
        keys = {"momentum_buffer"} if fqn in DEDICATED else {"step", "exp_avg", "exp_avg_sq"}
        assert set(entry) == keys and all(not v.any() for v in entry.values()), fqn
    st = state_of(fresh, "test")
    for dp in st.dparams:  # aliases: dcp.load writes the live masters and momentum in place
        assert template["model"][dp.fqn].data_ptr() == dp._owned_data.data_ptr()
        buf = template["optimizer"]["state"][dp.fqn]["momentum_buffer"]
        assert buf.data_ptr() == fresh_opt.state[dp.param]["momentum_buffer"].data_ptr()
    dcp.load(template, checkpoint_id=str(tmp_path))
    dmuon.set_model_state_dict(fresh, template["model"], full_state_dict=False)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, template["optimizer"], full_state_dict=False)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x(2)).backward()
        o.step()
    a, b = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = dmuon.get_optimizer_state_dict(model, opt), dmuon.get_optimizer_state_dict(fresh, fresh_opt)
    for fqn, entry in oa["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][fqn][key])), (fqn, key)


def test_sharded_setter_errors(one_rank):
    model, opt = _trained("fsdp", 1)
    sd = dmuon.get_model_state_dict(model, full_state_dict=False)
    missing = r"set_model_state_dict\(full_state_dict=False\): missing keys \['head.weight'\]"
    with pytest.raises(KeyError, match=missing):
        dmuon.set_model_state_dict(model, {k: v for k, v in sd.items() if k != "head.weight"}, full_state_dict=False)
    with pytest.raises(ValueError, match=r"'layers.0.up_proj.weight': the loaded local shard has shape \(3, 3\)"):
        dmuon.set_model_state_dict(model, {**sd, "layers.0.up_proj.weight": torch.zeros(3, 3)}, full_state_dict=False)
    osd = dmuon.get_optimizer_state_dict(model, opt, full_state_dict=False)
    groups = [dict(g) for g in osd["param_groups"]]
    groups[0]["params"] = groups[0]["params"][1:]
    with pytest.raises(ValueError, match=r"param group 0 \(\w+\) differs from the checkpoint's in \['"):
        dmuon.set_optimizer_state_dict(model, opt, {**osd, "param_groups": groups}, full_state_dict=False)
    state = dict(osd["state"])
    del state["head.weight"]
    with pytest.raises(KeyError, match=r"missing param states \['head.weight'\]"):
        dmuon.set_optimizer_state_dict(model, opt, {**osd, "state": state}, full_state_dict=False)


@pytest.mark.parametrize(
    ("call", "option"),
    [
        (lambda m, o: dmuon.get_model_state_dict(m, full_state_dict=False, rank0_only=True), "rank0_only"),
        (lambda m, o: dmuon.get_model_state_dict(m, full_state_dict=False, cpu_offload=True), "cpu_offload"),
        (lambda m, o: dmuon.get_optimizer_state_dict(m, o, full_state_dict=False, cpu_offload=True), "cpu_offload"),
        (lambda m, o: dmuon.set_model_state_dict(m, {}, full_state_dict=False, broadcast_from_rank0=True), "broadcast"),
        (
            lambda m, o: dmuon.set_optimizer_state_dict(m, o, {}, full_state_dict=False, broadcast_from_rank0=True),
            "broadcast",
        ),
    ],
)
def test_sharded_refuses_full_only_options(one_rank, call, option):
    """A sharded dict is each rank's share aliasing live storage: rank 0 alone, a CPU copy or a broadcast is refused."""
    model, opt = _trained("fsdp", 0)
    with pytest.raises(ValueError, match=rf"\(full_state_dict=False\): {option}\w* applies to full state dicts only"):
        call(model, opt)
