"""The optimizer components' checkpoint methods (the contract CheckpointManager uses: `model_state_dict`,
`load_model_state_dict`, `state_dict`, `load_state_dict`) for dmuon, muon_naive and adamw on one gloo rank:
FQN keys of the unwrapped model, a fresh component's dicts as complete DCP templates, and a dcp.save/load into
a fresh component that trains on bitwise like the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tests.optimizer_components import build_tiny, tiny_cfg, train_step
from titan_dmuon.parallel import ParallelDims


@pytest.fixture
def dims():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    finally:
        dist.destroy_process_group()


def _sd(component) -> dict:
    return {"model": component.model_state_dict(), "optimizer": component.state_dict()}


@pytest.mark.parametrize("name", ["dmuon", "muon_naive", "adamw"])
def test_component_checkpoint_round_trip(dims, tmp_path, name) -> None:
    model, component = build_tiny(tiny_cfg(name), dims)
    ref_model, ref = build_tiny(tiny_cfg(name), dims)
    for step in range(2):
        train_step(model, component, step)
        train_step(ref_model, ref, step)
    saved = _sd(component)
    assert list(saved["model"]) == list(model.state_dict())  # the unwrapped model's FQNs, in its order
    dcp.save(saved, checkpoint_id=str(tmp_path))

    fresh_model, fresh = build_tiny(tiny_cfg(name), dims)
    template = _sd(fresh)
    assert set(template["model"]) == set(saved["model"])
    assert set(template["optimizer"]["state"]) == set(saved["optimizer"]["state"])  # complete before any step
    for fqn, entry in saved["optimizer"]["state"].items():
        assert set(template["optimizer"]["state"][fqn]) == set(entry), fqn
    if name == "dmuon":  # the masters are fp32 plain tensors aliasing DMuon's, the rest FSDP2 DTensors
        from titan_dmuon.dmuon.state import state_of

        st = state_of(fresh_model, "test")
        masters = {dp.fqn: dp._owned_data for dp in st.dparams}
        for fqn, v in template["model"].items():
            if fqn in masters:
                assert v.dtype == torch.float32 and v.data_ptr() == masters[fqn].data_ptr(), fqn
            elif fqn in dict(fresh_model.named_parameters()):
                assert isinstance(v, DTensor), fqn
    dcp.load(template, checkpoint_id=str(tmp_path))
    fresh.load_model_state_dict(template["model"])
    fresh.load_state_dict(template["optimizer"])
    want = ref.model_state_dict()  # one rank: every value is whole (a registered DMuon param may be freed storage)
    for k, got in fresh.model_state_dict().items():
        got, v = (t.full_tensor() if isinstance(t, DTensor) else t for t in (got, want[k]))
        assert torch.equal(got, v), k
    for step in (2, 3):
        assert train_step(fresh_model, fresh, step) == train_step(ref_model, ref, step)
    for c in (component, ref, fresh):
        c.close()
