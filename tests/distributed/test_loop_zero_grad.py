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


def keep_after_the_no_grad_step(side: Side, steps: int) -> list[float]:
    """`optimizer.zero_grad()` after every step but the one where no rank uses `UNUSED_BY_ALL` (step 3), after which
    the grads are kept (`set_to_none=False`): that matrix's grad stays None there (torch's), and the next backward
    gives it one, which its step must apply (a has-grad flag left over from step 3 would skip it)."""
    losses = []
    for step in range(steps):
        loss = side.loss(step)
        loss.backward()
        side.opt.step()
        side.opt.zero_grad(set_to_none=step % 4 != 3)
        losses.append(side.mean(loss))
    return losses


LOOPS = {
    name: (functools.partial(plain_loop, clear=clear), None)
    for name, clear in (
        ("model.zero_grad()", model_zero_grad),
        ("model.zero_grad(set_to_none=False)", model_zero_grad_keep),
        ("p.grad = None", grads_to_none),
        ("optimizer.zero_grad(set_to_none=False)", optimizer_zero_grad_keep),
    )
}
LOOPS["set_to_none=False after the step no rank had a grad"] = (keep_after_the_no_grad_step, None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_way_of_clearing_grads_matches_reference(layout):
    check_loops(layout, LOOPS, steps=5)
