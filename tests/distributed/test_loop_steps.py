"""Loops that do not step once per backward, with conditional compute on: a step skipped after a bad loss
(zero_grad without step, through the optimizer or the model) and `step()` twice without a backward (torch's
optimizers then apply the same grad twice). Each matches the single-process reference on every layout
(tests/loops.py)."""

from __future__ import annotations

import pytest

from tests.loops import LAYOUTS, Side, check_loops


def skip_step(side: Side, steps: int, clear) -> list[float]:
    losses = []
    for step in range(steps):
        loss = side.loss(step)
        loss.backward()
        if step == 1:  # "the loss was NaN": drop this step's grads, do not step
            clear(side)
            losses.append(side.mean(loss))
            continue
        side.opt.step()
        side.opt.zero_grad()
        losses.append(side.mean(loss))
    return losses


def skip_step_optimizer(side: Side, steps: int) -> list[float]:
    return skip_step(side, steps, lambda s: s.opt.zero_grad())


def skip_step_model(side: Side, steps: int) -> list[float]:
    return skip_step(side, steps, lambda s: s.module.zero_grad())


def step_twice(side: Side, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = side.loss(step)
        loss.backward()
        side.opt.step()
        if step == 1:
            side.opt.step()
        side.opt.zero_grad()
        losses.append(side.mean(loss))
    return losses


LOOPS = {
    "skip a step: optimizer.zero_grad()": (skip_step_optimizer, None),
    "skip a step: model.zero_grad()": (skip_step_model, None),
    "step() twice without backward": (step_twice, None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_loops_match_reference(layout):
    check_loops(layout, LOOPS, steps=4)
