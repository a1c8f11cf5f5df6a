"""dmuon.fsdp_units: the blocks worth an FSDP2 unit of their own once DMuon took their matrices (the rule
train.py's titan_dmuon.parallel.fsdp_blocks uses), and the README's pattern built with it."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from tests.tiny_models import TinyMLP, batch, proj_predicate
from tests.unit.dmuon.helpers import FF, LAYERS, D, mesh1
from titan_dmuon import dmuon

WIDE = dict(d=16, ff=256, n_layers=2)  # a layer's LayerNorm is 32 of 12,320 params (0.26%) once its matrices go


def _wide() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP(**WIDE)


def _block(n_matrix: int, n_norm: int) -> nn.Module:
    b = nn.Module()
    b.w = nn.Parameter(torch.zeros(n_matrix))
    b.norm = nn.Parameter(torch.zeros(n_norm))
    return b


def test_default_blocks_are_every_layer_when_nothing_is_dedicated() -> None:
    model = TinyMLP(D, FF, LAYERS)
    assert dmuon.fsdp_units(model) == list(model.layers)


def test_default_blocks_are_the_outermost_layers_and_blocks() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    model.enc = nn.Module()
    model.enc.blocks = nn.ModuleList([nn.Module()])
    model.enc.blocks[0].layers = nn.ModuleList([nn.Linear(2, 2)])  # inside a block: not a block of its own
    model.head = nn.Linear(2, 2)
    assert dmuon.units.default_blocks(model) == [model.layers[0], model.layers[1], model.enc.blocks[0]]
    assert dmuon.fsdp_units(nn.Linear(2, 2)) == []  # no layers.N / blocks.N: the root unit alone


def test_threshold_and_ignored_params() -> None:
    """A block is a unit while FSDP2 shards >= 1% of its params: not when all but its norm is set aside (0.5%),
    at 1% yes, and not when nothing is left (nor for a block without params)."""
    blocks = [_block(199, 1), _block(99, 1), _block(100, 0), nn.Module()]
    assert dmuon.fsdp_units(None, blocks) == blocks[:3]
    ignored = {b.w for b in blocks[:3]}
    assert dmuon.fsdp_units(None, blocks, ignored_params=ignored) == [blocks[1]]
    assert dmuon.fsdp_units(None, blocks, ignored_params=ignored, min_fraction=0.004) == blocks[:2]


def test_dedicated_layers_leave_their_norms_to_the_root(one_rank) -> None:
    """The README's pattern on TinyMLP: every layer keeps only its LayerNorm for FSDP2 (< 1%), so no layer is a
    unit and the root unit shards the norms; training works and matches the per-layer loop's step."""
    model, reference = _wide(), _wide()
    for m in (model, reference):
        dmuon.dedicate_params(m, mesh1(), proj_predicate)
    assert dmuon.fsdp_units(model) == []
    for block in dmuon.fsdp_units(model):
        fully_shard(block, mesh=mesh1())
    fully_shard(model, mesh=mesh1())
    for layer in reference.layers:  # the slower per-layer loop: same numbers
        fully_shard(layer, mesh=mesh1())
    fully_shard(reference, mesh=mesh1())
    assert not any(isinstance(layer, FSDPModule) for layer in model.layers)
    assert isinstance(model, FSDPModule)
    opts = [dmuon.Muon(m, lr=0.02, adamw_lr=1e-3) for m in (model, reference)]
    for step in range(2):
        for m, opt in zip((model, reference), opts, strict=True):
            m(batch(step, 0, 4, WIDE["d"])).backward()
            opt.step()
            opt.zero_grad()
    a, b = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_framework_fsdp_blocks_is_the_library_rule() -> None:
    from titan_dmuon.parallel import fsdp_blocks

    model = _wide()
    blocks = [(f"layers.{i}", m) for i, m in enumerate(model.layers)]
    ignored = {p for n, p in model.named_parameters() if proj_predicate(n, p)}
    assert fsdp_blocks(blocks, set()) == dmuon.fsdp_units(model) == list(model.layers)
    assert fsdp_blocks(blocks, ignored) == dmuon.fsdp_units(model, ignored_params=ignored) == []
