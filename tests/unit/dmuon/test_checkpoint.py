"""dmuon's full state dicts on one rank (titan_dmuon.dmuon.checkpoint): keys as a plain `model.state_dict()`
(also through a torch DDP wrapper), a round trip that resumes bitwise, and the setters' errors."""

from __future__ import annotations

import pytest
import torch

from tests.unit.dmuon.helpers import dedicated, tiny, torch_ddp, x
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
