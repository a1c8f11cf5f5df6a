"""torch.compile of each block (as `Module.compile` does, and as the trainer does: the block's forward body) and
of the whole model over DMuon's hooks (which run eagerly: dynamo breaks the graph around them), with conditional
compute on, against the single-process reference (tests/loops.py) on dp2 x tp2 (DMuon's broadcast/reduce hooks of the
FSDP path around compiled code, and TP's DTensors) and on DDP (the replicate path's hooks); the other layouts differ
from these only in their communication, which runs eager outside the compiled graphs and which
test_loop_steps.py checks layout by layout. The `aot_eager` backend
traces through dynamo and AOTAutograd as inductor does, without its C++ build (minutes on CI's two cores).

On dp2 x tp2 the dedicated matrices are DTensors whose local tensors are views of DMuon's packed buffer: dynamo
must be able to fake them (`DedicatedParam.set_local`)."""

from __future__ import annotations

import pytest
import torch

from tests.loops import LoopLlama, check_loops, plain_loop


def compile_blocks(model: LoopLlama) -> LoopLlama:
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    return model


def compile_block_bodies(model: LoopLlama) -> LoopLlama:
    """The trainer's way (titan_dmuon/parallel/parallelize.py, `apply_compile`): the hooks stay outside."""
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    return model


def compile_model(model: LoopLlama):
    return torch.compile(model, backend="aot_eager")


LOOPS = {
    "compiled blocks": (plain_loop, compile_blocks),
    "compiled block bodies": (plain_loop, compile_block_bodies),
    "compiled model": (plain_loop, compile_model),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp_tp", "ddp"])
def test_compiled_loops_match_reference(layout):
    check_loops(layout, LOOPS, steps=4)
