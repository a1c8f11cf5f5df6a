"""Conditional compute under DMuon: on each step one rank leaves out a Muon matrix or a whole branch (an
optional branch, a modality tower on a text-only batch, an expert that got no tokens), and every 4th step a
matrix no rank uses. No hang, the absent grads count as zeros, and the unused matrix is skipped by its owner
as torch.optim.Muon skips a None grad (no momentum, no weight decay). Against the single-process reference on
every layout (tests/loops.py)."""

from __future__ import annotations

import pytest

from tests.loops import LAYOUTS, check_loops, plain_loop

LOOPS = {"conditional": (plain_loop, None)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conditional_compute_matches_reference(layout):
    check_loops(layout, LOOPS, steps=8)
