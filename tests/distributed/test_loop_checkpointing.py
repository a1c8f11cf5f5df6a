"""Activation checkpointing as Hugging Face models do it, each block under torch.utils.checkpoint, reentrant
(its first forward runs without grad, so DMuon learns of the block only from the recompute inside backward)
and non-reentrant, with conditional compute on: Muon keeps updating and matches the single-process reference
on every layout (tests/loops.py)."""

from __future__ import annotations

import functools

import pytest

from tests.loops import LAYOUTS, LoopLlama, check_loops, plain_loop


def with_checkpointing(model: LoopLlama, mode: str) -> LoopLlama:
    model.checkpointing = mode
    return model


LOOPS = {
    mode: (plain_loop, functools.partial(with_checkpointing, mode=mode)) for mode in ("reentrant", "non_reentrant")
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpointed_blocks_match_reference(layout):
    check_loops(layout, LOOPS, steps=5)
