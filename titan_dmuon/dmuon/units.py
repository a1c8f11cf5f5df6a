"""Which modules deserve an FSDP2 unit of their own once DMuon took their matrices (docs/dmuon.md, "Which
modules are FSDP2 units").

    dmuon.dedicate_params(model, mesh, predicate)
    for block in dmuon.fsdp_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: embeddings, output, and the other blocks' leftover params
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch.nn as nn

MIN_UNIT_FRACTION = 0.01
"""A block is an FSDP2 unit of its own only while FSDP2 still shards at least this fraction of its params.
With DMuon a Llama block keeps only its two norm vectors (2·dim of ~12·dim² elements): as a unit it would
cost an all-gather in forward, another in backward and a reduce-scatter per block per step, each a fixed
collective latency for a few KB. Left to the root unit they are gathered with the embeddings, once per step
(twice with reshard_after_forward=True on the root): all blocks' norms, 2·dim·n_layers elements (4.1M at 405B),
unsharded from forward to the end of backward."""

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+$")


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's `layers.N` / `blocks.N` modules (outermost ones, in module order): where DMuon's hooks attach
    by default, and the modules a per-layer `fully_shard` loop would wrap."""
    out, names = [], []
    for name, module in model.named_modules():
        if _BLOCK_RE.search(name) and not any(name.startswith(n + ".") for n in names):
            out.append(module)
            names.append(name)
    return out


def fsdp_units(
    model: nn.Module | None,
    blocks: Iterable[nn.Module] | None = None,
    *,
    ignored_params: Iterable[nn.Parameter] = (),
    min_fraction: float = MIN_UNIT_FRACTION,
) -> list[nn.Module]:
    """The blocks worth an FSDP2 unit of their own, in order: `fully_shard` each, then the root.

    `blocks` defaults to the model's `layers.N` / `blocks.N` modules (`model` is only used to find them; pass
    None with explicit `blocks`). A block is kept while the params FSDP2 will shard (not dedicated by
    `dmuon.dedicate_params`, not in `ignored_params`) are at least `min_fraction` of its params; every block is
    kept on a model with nothing dedicated or ignored. A block whose params are (almost) all dedicated is left
    out: its leftover params (norms) join the root unit, gathered once with the embeddings instead of costing
    three collectives per block per step. Call it after `dedicate_params` and before `fully_shard`.
    """
    if blocks is None:
        if model is None:
            raise ValueError("dmuon.fsdp_units: pass the model (its layers.N / blocks.N are the blocks) or blocks")
        blocks = default_blocks(model)
    ignored = set(ignored_params)
    out = []
    for block in blocks:
        total = kept = 0
        for p in block.parameters():
            total += p.numel()
            # the params FSDP2 skips: ignored_params, and what dedicate_params tagged (fsdp2_patch.py)
            if p not in ignored and not hasattr(p, "_dedicated_owner_rank"):
                kept += p.numel()
        if kept and kept >= min_fraction * total:
            out.append(block)
    return out
