"""DMuonState and DedicatedParamGroup on one rank (titan_dmuon.dmuon.state, .group): how the packed buffer is
laid out, unshard/reshard, the reduce onto the (single) owner, partly-arrived groups, no_sync, the optimizer's
`after_step` handoff, and finding the state from a model (`state_of`, through a DDP wrapper)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.dmuon_harness import grad_left_to_owner
from tests.unit.dmuon.helpers import DEDICATED, D, dedicated, mesh1, tiny, torch_ddp, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.comm import Work
from titan_dmuon.dmuon.state import find_state, state_of, unwrap


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().size()


def test_packing_layout(one_rank):
    _, model = dedicated(tiny())
    st = state_of(model, "test")
    assert [g.module_fqn for g in st.groups] == ["layers.0", "layers.1"]  # forward (registration) order
    assert sorted(dp.fqn for dp in st.dparams) == sorted(DEDICATED)
    for g in st.groups:
        assert [dp.fqn for dp in g.params] == sorted(dp.fqn for dp in g.params)  # one owner: by fqn
        offset = 0
        for dp in g.params:  # contiguous, in order, no gaps
            assert (dp.offset, dp.group) == (offset, g)
            offset += dp.numel
        assert g.numel == offset == g.buffer.numel()
        assert g.shard_segments == {0: (0, g.numel)} and g.owner_segments == {(0, 0): (0, g.numel)}
        assert _storage(g.buffer) == 0  # placeholder until the first unshard
        for dp in g.params:
            assert dp.param.shape == dp.full_shape and _storage(dp.param) == 0
            assert dp.param._dedicated_owner_rank == 0 and dp.param._dmuon_param is dp
            assert dp.is_owner and dp.in_owner_column and dp._owned_data.dtype == torch.float32


def test_unshard_copies_masters_and_reshard_frees(one_rank):
    plain, model = dedicated(tiny())
    g = state_of(model, "test").groups[0]
    g.unshard()
    g.wait_for_unshard()
    assert g.unsharded and _storage(g.buffer) == g.numel * g.buffer.element_size()
    for dp in g.params:
        assert dp.param.data_ptr() == g.buffer[dp.offset :].data_ptr()  # a view into the packed buffer
        assert torch.equal(dp.param, plain.get_parameter(dp.fqn))
    g.unshard()  # idempotent
    g.reshard()
    assert not g.unsharded and _storage(g.buffer) == 0
    g.reshard()  # idempotent


@pytest.mark.parametrize("z3", [True, False], ids=["Z3", "Z2"])
def test_buffer_life_in_forward_and_backward(one_rank, z3):
    """Z3 frees the buffer after forward and unshards again in backward; Z2 keeps it; both free it once
    the grads are reduced, and a no-grad forward always frees it."""
    _, model = dedicated(tiny(), reshard_after_forward=z3)
    st = state_of(model, "test")
    loss = model(x())
    assert [g.unsharded for g in st.groups] == [not z3] * len(st.groups)
    loss.backward()
    assert not any(g.unsharded for g in st.groups)
    with torch.no_grad():
        model(x())
    assert not any(g.unsharded for g in st.groups)


def test_reduce_onto_the_owner(one_rank):
    """On one rank the AVG reduce is the identity: the owner's fp32 `_reduced_grad` is the plain grad, the
    dedicated `param.grad` is dropped, the other params keep theirs; a second backward accumulates."""
    plain, model = dedicated(tiny())
    st = state_of(model, "test")
    plain(x()).backward()
    model(x()).backward()
    for dp in st.dparams:
        assert grad_left_to_owner(dp.param)
        torch.testing.assert_close(dp._reduced_grad, plain.get_parameter(dp.fqn).grad, rtol=0, atol=0)
    for n, p in model.named_parameters():
        if n not in DEDICATED:
            torch.testing.assert_close(p.grad, plain.get_parameter(n).grad, rtol=0, atol=0)
    model(x()).backward()
    for dp in st.dparams:
        torch.testing.assert_close(dp._reduced_grad, 2 * plain.get_parameter(dp.fqn).grad)


def test_no_sync_keeps_local_grads_and_the_next_backward_reduces_the_sum(one_rank):
    plain, model = dedicated(tiny())
    st = state_of(model, "test")
    for step in (0, 1):
        plain(x(step)).backward()
    with st.no_sync():
        assert not st.sync_grads
        model(x(0)).backward()
    assert st.sync_grads
    for dp in st.dparams:
        assert dp._reduced_grad is None and dp.param.grad is not None  # local, not reduced
    model(x(1)).backward()
    for dp in st.dparams:
        assert grad_left_to_owner(dp.param)
        torch.testing.assert_close(dp._reduced_grad, plain.get_parameter(dp.fqn).grad)


class _TwoProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_proj = nn.Linear(D, D, bias=False)
        self.b_proj = nn.Linear(D, D, bias=False)

    def forward(self, h: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a_proj(h) + (self.b_proj(h) if use_b else 0)


class _Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_TwoProj()])

    def forward(self, h: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.layers[0](h, use_b).pow(2).mean()


def test_partly_arrived_group_is_reduced_with_zeros_at_the_end_of_backward(one_rank):
    torch.manual_seed(0)
    model = _Partial()
    dmuon.dedicate_params(model, mesh1(), lambda n, p: "proj" in n)
    a, b = state_of(model, "test").groups[0].params
    model(x(), use_b=False).backward()  # b_proj gets no grad: only the end-of-backward callback reduces
    assert a._reduced_grad is not None and a._reduced_grad.abs().sum() > 0
    assert torch.equal(b._reduced_grad, torch.zeros_like(b._reduced_grad))


def test_after_step_hands_over_publish_and_deferred_tail(one_rank):
    """The optimizer's handoff: nothing runs until the group's next wait_publish, which runs the deferred
    tail once and waits the merged publish; a second handoff before that is an error."""
    _, model = dedicated(tiny())
    st = state_of(model, "test")
    g = st.groups[0]
    calls = []

    def finish() -> Work:
        calls.append("finish")
        return Work()

    g.after_step(Work(), finish)
    assert calls == []
    with pytest.raises(RuntimeError, match="not consumed"):
        g.after_step(Work())
    st.drain_publish()
    assert calls == ["finish"]
    st.drain_publish()
    assert calls == ["finish"]
    g.after_step(Work())  # consumed: the next handoff is welcome
    model(x())  # the pre-forward consumes it
    g.after_step(Work(), finish)


def test_muon_step_hands_every_group_over(one_rank, monkeypatch):
    _, model = dedicated(tiny())
    st = state_of(model, "test")
    opt = dmuon.Muon(model)
    seen = []
    for g in st.groups:
        original = g.after_step
        monkeypatch.setattr(
            g, "after_step", lambda work, finish=None, g=g, f=original: (seen.append(g), f(work, finish))
        )
    model(x()).backward()
    opt.step()
    assert seen == st.groups


def test_state_of_finds_the_state_through_a_ddp_wrapper(one_rank):
    model = tiny()
    assert find_state(model) is None
    with pytest.raises(RuntimeError, match=r"^get_owned_params: .*before dmuon.dedicate_params"):
        state_of(model, "get_owned_params")
    wrapped = torch_ddp(model)
    assert unwrap(wrapped) is model and unwrap(model) is model
    assert state_of(wrapped, "test") is state_of(model, "test") is find_state(wrapped)
