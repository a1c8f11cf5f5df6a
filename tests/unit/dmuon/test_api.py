"""dmuon.dedicate_params and friends on one rank (titan_dmuon.dmuon.api): what they return and tag, and every
error a user can hit, each naming the problem and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from tests.tiny_models import TinyMLP
from tests.unit.dmuon.helpers import DEDICATED, FF, LAYERS, D, mesh1, tiny, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.state import state_of


def _proj(n, p):
    return "proj" in n and p.ndim == 2


def test_returns_owners_and_get_owned_params(one_rank):
    model = tiny()
    owners = dmuon.dedicate_params(model, mesh1(), _proj)
    names = {p: n for n, p in model.named_parameters()}
    assert sorted(names[p] for p in owners) == sorted(DEDICATED) and set(owners.values()) == {0}
    assert sorted(dp.fqn for dp in dmuon.get_owned_params(model)) == sorted(DEDICATED)
    assert dmuon.get_owned_params(model, 0) == dmuon.get_owned_params(model)
    assert state_of(model, "test").mode == "fsdp"


def test_ddp_owners_are_mesh_ranks(one_rank):
    owners = dmuon.dedicate_params_ddp(tiny(), mesh1("dp"), _proj)
    assert len(owners) == len(DEDICATED) and set(owners.values()) == {0}


def test_predicate_selecting_a_non_2d_tensor(one_rank):
    with pytest.raises(ValueError, match=r"'layers\.0\.ln\.weight' with shape \(8,\).*p\.ndim in \(2, 3\)"):
        dmuon.dedicate_params(tiny(), mesh1(), lambda n, p: "layers" in n)


def test_model_already_under_fsdp2(one_rank):
    model = tiny()
    fully_shard(model, mesh=mesh1())
    with pytest.raises(RuntimeError, match="before fully_shard"):
        dmuon.dedicate_params(model, mesh1(), _proj)


def test_model_already_wrapped_in_torch_ddp(one_rank):
    with pytest.raises(RuntimeError, match="before DistributedDataParallel"):
        dmuon.dedicate_params_ddp(DistributedDataParallel(tiny()), mesh1("dp"), _proj)


def test_unnamed_mesh_with_tp_dtensors(one_rank):
    """TP dims are told from DP dims by name: a TP DTensor on an unnamed mesh cannot be placed."""
    model = tiny()
    parallelize_module(model.layers[0], mesh1(), {"gate_proj": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'layers\.0\.gate_proj\.weight' is a DTensor on an unnamed mesh"):
        dmuon.dedicate_params(model, mesh1("dp"), _proj)


def test_called_twice(one_rank):
    model = tiny()
    dmuon.dedicate_params(model, mesh1(), _proj)
    with pytest.raises(RuntimeError, match="already called"):
        dmuon.dedicate_params(model, mesh1(), _proj)
    with pytest.raises(RuntimeError, match="already applied"):
        dmuon.dedicate_params_ddp(model, mesh1("dp"), _proj)


def test_meshes(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=r"1D mesh.*replicate_mesh"):
        dmuon.dedicate_params(tiny(), mesh2d, _proj)
    with pytest.raises(ValueError, match=r"named 'dp' but HSDP needs mesh_dim_names \('replicate', 'shard'\)"):
        dmuon.dedicate_params(tiny(), mesh1("dp"), _proj, replicate_mesh=mesh1("replicate"))
    with pytest.raises(TypeError, match="must be a torch.distributed DeviceMesh"):
        dmuon.dedicate_params(tiny(), "cpu", _proj)


def test_selection_problems(one_rank):
    with pytest.raises(ValueError, match="selected no 2D/3D parameter"):
        dmuon.dedicate_params(tiny(), mesh1(), lambda n, p: False)
    with torch.device("meta"):
        meta = TinyMLP(D, FF, LAYERS)
    meta.layers[0].gate_proj.to_empty(device="cpu")  # one selected matrix materialized, the others not
    with pytest.raises(ValueError, match=r"'layers\.0\.up_proj\.weight' is on the meta device but other"):
        dmuon.dedicate_params(meta, mesh1(), _proj)
    frozen = tiny()
    frozen.layers[0].gate_proj.weight.requires_grad_(False)  # skipped, not an error
    owners = dmuon.dedicate_params(frozen, mesh1(), _proj)
    assert frozen.layers[0].gate_proj.weight not in owners and len(owners) == len(DEDICATED) - 1


def _from(reference: nn.Module):
    """An init_fn that copies `reference`'s values at the region asked for."""
    values = dict(reference.named_parameters())

    def init_fn(fqn, out, region):
        out.copy_(values[fqn].detach()[region])

    return init_fn


@pytest.mark.parametrize("ddp", [False, True], ids=["fsdp", "ddp"])
def test_meta_dedicate_records_owners_then_init_allocates(one_rank, ddp):
    """On meta, dedicate_params records who owns what and allocates nothing; init_dedicated_params allocates the
    masters on the device and fills them from init_fn; the model then trains like the materialized one."""
    plain, ref = tiny(), tiny()
    dmuon.dedicate_params(ref, mesh1(), _proj) if not ddp else dmuon.dedicate_params_ddp(ref, mesh1("dp"), _proj)
    with torch.device("meta"):
        model = TinyMLP(D, FF, LAYERS)
    dedicate = dmuon.dedicate_params_ddp if ddp else dmuon.dedicate_params
    owners = dedicate(model, mesh1("dp") if ddp else mesh1(), _proj)
    names = {p: n for n, p in model.named_parameters()}
    assert sorted(names[p] for p in owners) == sorted(DEDICATED)
    dps = dmuon.get_dedicated_params(model)
    assert sorted(dp.fqn for dp in dps) == sorted(DEDICATED)
    assert all(dp._owned_data is None and dp.param.is_meta for dp in dps)
    with pytest.raises(RuntimeError, match="still on the meta device: call dmuon.init_dedicated_params"):
        dmuon.Muon(model)
    with pytest.raises(ValueError, match="not meta"):
        dmuon.init_dedicated_params(model, _from(plain), "meta")
    dedicated_before = [id(p) for n, p in model.named_parameters() if n in DEDICATED]
    model.head.to_empty(device="cpu")
    model.head.weight.data.copy_(plain.head.weight)
    for layer, src in zip(model.layers, plain.layers, strict=True):
        layer.ln.to_empty(device="cpu")
        layer.ln.load_state_dict(src.ln.state_dict())
    dmuon.init_dedicated_params(model, _from(plain), "cpu")
    # the same Parameter objects (FSDP2's ignored set and the optimizer hold them), now on the CPU
    assert [id(p) for n, p in model.named_parameters() if n in DEDICATED] == dedicated_before
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(hasattr(p, "_dmuon_param") for p in owners)
    with pytest.raises(RuntimeError, match="not on the meta device"):
        dmuon.init_dedicated_params(model, _from(plain), "cpu")
    for dp in dps:
        torch.testing.assert_close(dp._owned_data, dict(plain.named_parameters())[dp.fqn], rtol=0, atol=0)
    for m in (model, ref):
        opt = dmuon.Muon(m, lr=0.02)
        for step in range(2):
            m(x(step)).backward()
            opt.step()
            opt.zero_grad()
    got, want = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(ref)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_tp_buffer_reuse_value(one_rank):
    with pytest.raises(ValueError, match="tp_buffer_reuse must be"):
        dmuon.dedicate_params(tiny(), mesh1(), _proj, tp_buffer_reuse="sometimes")
