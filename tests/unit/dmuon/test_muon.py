"""dmuon.Muon's construction on one rank (titan_dmuon.dmuon.muon): what it refuses and why, its param
groups, and zero_grad. The update rule itself: test_muon_update.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.unit.dmuon.helpers import DEDICATED, dedicated, tiny, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.state import state_of


def test_model_without_dedicated_params(one_rank):
    with pytest.raises(RuntimeError, match=r"dmuon.Muon: the model has no dedicated params .*before dmuon"):
        dmuon.Muon(tiny())


def test_bad_options(one_rank):
    _, model = dedicated(tiny())
    with pytest.raises(ValueError, match="adjust_lr_fn must be"):
        dmuon.Muon(model, adjust_lr_fn="sqrt")
    with pytest.raises(ValueError):
        dmuon.Muon(model, ns_coefficients="no such set")


def test_a_replaced_dedicated_param_is_refused(one_rank):
    """A wrapper that swaps params after dedicate_params (torch DDP's TP transform does) leaves DMuon's hooks
    on tensors the model no longer uses: refused, naming the param."""
    _, model = dedicated(tiny())
    lin = model.layers[0].up_proj
    lin.weight = nn.Parameter(torch.zeros(lin.weight.shape))  # (the placeholder has no storage to copy)
    with pytest.raises(RuntimeError, match=r"\['layers.0.up_proj.weight'\] are no longer registered"):
        dmuon.Muon(model)


def test_param_groups_and_zero_grad(one_rank):
    _, model = dedicated(tiny())
    opt = dmuon.Muon(model)
    names = {p: n for n, p in model.named_parameters()}
    kinds = {names[p]: g["kind"] for g in opt.param_groups for p in g["params"]}
    assert kinds == {n: "muon" if n in DEDICATED else "adamw" for n in names.values()}
    model(x()).backward()
    st = state_of(model, "test")
    assert all(dp._reduced_grad is not None for dp in st.dparams)
    opt.zero_grad()
    assert all(dp._reduced_grad is None for dp in st.dparams)
    assert all(p.grad is None for p in model.parameters())
