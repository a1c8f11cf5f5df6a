"""dmuon.clip_grad_norm_ on one rank (titan_dmuon.dmuon.clip): one global L2 norm over the owners' reduced
grads and every other grad (FSDP2 DTensors, plain tensors), equal to torch's on a plain copy of the model."""

from __future__ import annotations

import pytest
import torch

from tests.unit.dmuon.helpers import DEDICATED, dedicated, mesh1, tiny, torch_ddp, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.state import state_of


def _layout(name: str):
    """(plain copy, model as the user passes it) for "plain", "fsdp" (FSDP2 on the rest) and "torch_ddp"."""
    from torch.distributed.fsdp import fully_shard

    plain, model = dedicated(tiny()) if name != "torch_ddp" else (tiny(), None)
    if name == "fsdp":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh1())
        fully_shard(model, mesh=mesh1())
    if name == "torch_ddp":
        model = torch_ddp(tiny())
    return plain, model


@pytest.mark.parametrize("layout", ["plain", "fsdp", "torch_ddp"])
@pytest.mark.parametrize("max_norm", [1e-3, float("inf")], ids=["clips", "norm_only"])
def test_matches_torch_clip_on_a_plain_copy(one_rank, layout, max_norm):
    plain, model = _layout(layout)
    opt = dmuon.Muon(model)
    plain(x()).backward()
    model(x()).backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
    got = dmuon.clip_grad_norm_(model, opt, max_norm)
    torch.testing.assert_close(got, want)
    st = state_of(model, "test")
    for dp in st.dparams:
        torch.testing.assert_close(dp._reduced_grad, plain.get_parameter(dp.fqn).grad)
    module = getattr(model, "module", model)
    for n, p in module.named_parameters():
        if n not in DEDICATED:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(g, plain.get_parameter(n).grad)


def test_errors(one_rank):
    _, model = dedicated(tiny())
    with pytest.raises(ValueError, match="L2 norm only"):
        dmuon.clip_grad_norm_(model, None, 1.0, norm_type=1.0)
    with pytest.raises(RuntimeError, match="^clip_grad_norm_: the model has no dedicated params"):
        dmuon.clip_grad_norm_(tiny(), None, 1.0)
