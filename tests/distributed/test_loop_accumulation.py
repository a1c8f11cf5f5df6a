"""Loops with more than one forward per step, with conditional compute on: gradient accumulation with
`no_sync` on some micro-batches, two forwards before one backward, a forward in train mode whose graph is
held over the training backward and never backpropagated (an evaluation inside training), and a loss on an
intermediate layer (backward through part of the model). Each matches the single-process reference on every
layout (tests/loops.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.loops import LAYOUTS, Side, check_loops, two_forwards_one_backward


def _step(side: Side) -> None:
    side.opt.step()
    side.opt.zero_grad()


def _accumulate(side: Side, steps: int, around_step, around_micro) -> list[float]:
    """Two micro-batches a step (mean of their losses), each forward-backward inside `around_micro(step, micro)`,
    both inside `around_step()`; then one optimizer step."""
    losses = []
    for step in range(steps):
        total = 0.0
        with around_step():
            for micro in range(2):
                with around_micro(step, micro):
                    loss = side.loss(10 * step + micro) / 2
                    loss.backward()
                total += side.mean(loss)
        _step(side)
        losses.append(total)
    return losses


def accumulate_with_no_sync(side: Side, steps: int) -> list[float]:
    """On even steps the first micro-batch inside no_sync."""

    def quiet(step: int, micro: int):
        return side.no_sync() if micro == 0 and step % 2 == 0 else contextlib.nullcontext()

    return _accumulate(side, steps, contextlib.nullcontext, quiet)


def eval_forward_held(side: Side, steps: int) -> list[float]:
    """A train-mode forward with grad (its graph kept alive) before each training step."""
    losses = []
    for step in range(steps):
        held = side.loss(100 + step)
        loss = side.loss(step)
        loss.backward()
        _step(side)
        losses.append(side.mean(loss) + 0 * side.mean(held))
        del held
    return losses


def intermediate_loss(side: Side, steps: int) -> list[float]:
    """On odd steps the loss is taken after block 0: block 1 runs forward and gets no grad."""
    losses = []
    for step in range(steps):
        loss = side.loss(step, loss_at=0 if step % 2 else None)
        loss.backward()
        _step(side)
        losses.append(side.mean(loss))
    return losses


LOOPS = {
    "no_sync on some micro-batches": (accumulate_with_no_sync, None),
    "two forwards, one backward": (two_forwards_one_backward, None),
    "train-mode forward without backward": (eval_forward_held, None),
    "loss on an intermediate layer": (intermediate_loss, None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulation_loops_match_reference(layout):
    check_loops(layout, LOOPS, steps=4)


def accumulate_in_one_autocast_region(side: Side, steps: int) -> list[float]:
    """Two micro-batches a step, both forward-backwards inside one bf16 autocast region (autocast's cast cache
    then outlives the first backward: DMuon drops it when the next forward begins). The step is outside the
    region, as torch's autocast docs ask (inside, the cache would feed the next forwards pre-step weights)."""

    def region():
        return torch.autocast(side.device_type, dtype=torch.bfloat16)

    return _accumulate(side, steps, region, lambda step, micro: contextlib.nullcontext())


def test_accumulation_in_one_autocast_region_matches_reference():
    """bf16 matmuls: held to bf16's precision, not fp32's (without the fix the second micro-batch's backward
    raised DMuon's late-grad error)."""
    check_loops("fsdp", {"accumulation in one autocast region": (accumulate_in_one_autocast_region, None)}, 3, 2e-2)
