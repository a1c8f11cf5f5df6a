"""Clearing grads the ways loops do: `model.zero_grad()` (Hugging Face's Trainer), with `set_to_none=False`,
`p.grad = None` on every param, `optimizer.zero_grad(set_to_none=False)`. After each, DMuon keeps no stale
reduced grad (a clear reaches the owner through the placeholder grad a reduce leaves on the param), so the run
matches the single-process reference on every layout (tests/loops.py), with conditional compute on."""

from __future__ import annotations

import functools

import pytest

from tests.loops import LAYOUTS, Side, check_loops, plain_loop


def model_zero_grad(side: Side) -> None:
    side.module.zero_grad()


def model_zero_grad_keep(side: Side) -> None:
    side.module.zero_grad(set_to_none=False)


def grads_to_none(side: Side) -> None:
    for p in side.module.parameters():
        p.grad = None


def optimizer_zero_grad_keep(side: Side) -> None:
    side.opt.zero_grad(set_to_none=False)


LOOPS = {
    name: (functools.partial(plain_loop, clear=clear), None)
    for name, clear in (
        ("model.zero_grad()", model_zero_grad),
        ("model.zero_grad(set_to_none=False)", model_zero_grad_keep),
        ("p.grad = None", grads_to_none),
        ("optimizer.zero_grad(set_to_none=False)", optimizer_zero_grad_keep),
    )
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_way_of_clearing_grads_matches_reference(layout):
    check_loops(layout, LOOPS, steps=5)
