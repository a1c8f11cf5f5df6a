"""The training loops users write, run on real gloo ranks through DMuon's public API and, side by side, in one
process with torch.optim.Muon (fp32 NS) + torch.optim.AdamW (tests/reference.py, which imports nothing of
titan_dmuon).

Every loop runs on `LoopLlama`, whose blocks skip a Muon matrix (or a whole branch of them) on the ranks a
schedule names: a different matrix on a different rank every step, and on some steps a matrix no rank uses
(`skips`). The reference computes each data-parallel rank's loss on its own batch with its own skips and
backpropagates their mean, so its grads are the average over ranks with a rank that had no grad counting as
zero, and a matrix no rank used has no grad (torch.optim.Muon skips it).

A loop is a function `loop(side, steps) -> list[float]` written once against `Side`, which hides only what
differs between the two: where the batches come from and which optimizer steps. `run_layout` runs loops on a
layout (1D FSDP2, HSDP 2x2, dp2 x tp2, DDP) and returns each loop's losses and final weights; `check_loops`
holds them against the reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests._dist import rank_device, run_distributed
from tests.dmuon_harness import HP, build_muon, shard_blocks
from tests.reference import fp32_torch_muon, reference_optimizers, rel_err
from tests.tiny_models import LlamaBlock, apply_llama_tp, proj_predicate, seq_batch

D, FF, HEADS, LAYERS, B, T = 16, 32, 2, 2, 2, 4
RTOL = 5e-5
# What a block can skip: one matrix, another, a whole branch (3 and 4 matrices). The block's norms are always
# used (FSDP2 reduce-scatters a norm's grad only where it has one), so only Muon matrices go without grads.
SKIPPABLE = ("mlp.up_proj", "self_attn", "mlp.gate_proj", "mlp")
UNUSED_BY_ALL = "layers.1.mlp.up_proj"  # every 4th step no rank uses it
# world size, and how a rank finds its data-parallel coordinate, per layout
LAYOUTS = {"fsdp": 2, "hsdp": 4, "dp_tp": 4, "ddp": 2}


def skips(step: int, dp_rank: int, n_dp: int) -> frozenset[str]:
    """The matrices (FQN prefixes) data-parallel rank `dp_rank` does not use at `step`: one rank a step, the
    rank, block and what it skips changing every step; every 4th step, `UNUSED_BY_ALL` on every rank."""
    if step % 4 == 3:
        return frozenset({UNUSED_BY_ALL})
    if dp_rank != step % n_dp:
        return frozenset()
    return frozenset({f"layers.{step % LAYERS}.{SKIPPABLE[step % len(SKIPPABLE)]}"})


class LoopBlock(LlamaBlock):
    """A llama block that can leave out some of its matrices (conditional compute: an optional branch, an
    expert that got no tokens). A skipped branch still uses its norm, times zero."""

    def forward(self, x: torch.Tensor, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        a = self.attn_norm(x)
        x = x + (0.0 * a if "self_attn" in skip else self.self_attn(a))
        m = self.mlp_norm(x)
        if "mlp" in skip:
            return x + 0.0 * m
        act = torch.nn.functional.silu(self.mlp.gate_proj(m)) if "mlp.gate_proj" not in skip else 1.0
        up = self.mlp.up_proj(m) if "mlp.up_proj" not in skip else 1.0
        return x + self.mlp.down_proj(act * up)


class LoopLlama(nn.Module):
    """embed (AdamW: the blocks' input requires grad, as in an LM) -> blocks -> norm -> head; loss = mean
    square of the head's output, at the last block or at `loss_at` (a loss on an intermediate layer: the later
    blocks run forward and get no backward). `checkpointing`: None, "reentrant" or "non_reentrant" (each block
    wrapped by torch.utils.checkpoint, as Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList([LoopBlock(D, FF, HEADS) for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, 4, bias=False)
        self.checkpointing: str | None = None

    def forward(self, x: torch.Tensor, skip: frozenset[str] = frozenset(), loss_at: int | None = None):
        h = self.embed(x)
        hidden = []
        for i, layer in enumerate(self.layers):
            mine = frozenset(s.removeprefix(f"layers.{i}.") for s in skip if s.startswith(f"layers.{i}."))
            if self.checkpointing is None:
                h = layer(h, mine)
            else:
                h = checkpoint(layer, h, mine, use_reentrant=self.checkpointing == "reentrant")
            hidden.append(h)
        out = hidden[-1 if loss_at is None else loss_at]
        return self.head(self.norm(out)).pow(2).mean()


class Side:
    """What a loop sees of one side: the model, the optimizer (`step`, `zero_grad`), and `loss(key)`: this
    rank's loss on its batch `key` with its skips (DMuon), or the mean of every rank's (the reference)."""

    def __init__(self, model: nn.Module, opt, n_dp: int, dp_rank: int | None, module: nn.Module | None = None):
        self.model, self.opt, self.n_dp, self.dp_rank = model, opt, n_dp, dp_rank
        self.module = module if module is not None else model  # the LoopLlama under any wrapper
        self.distributed = dp_rank is not None

    def loss(self, key: int, loss_at: int | None = None, model: nn.Module | None = None) -> torch.Tensor:
        model = self.model if model is None else model
        if self.distributed:
            x = seq_batch(key, self.dp_rank, B, T, D).to(rank_device())
            return model(x, skips(key, self.dp_rank, self.n_dp), loss_at)
        losses = [model(seq_batch(key, r, B, T, D), skips(key, r, self.n_dp), loss_at) for r in range(self.n_dp)]
        return torch.stack(losses).mean()

    @property
    def device_type(self) -> str:
        return rank_device().type if self.distributed else "cpu"

    def no_sync(self):
        """The grad-accumulation context: DMuon's (and FSDP2's, replicate's) reduces off; nothing to turn off
        in one process."""
        if not self.distributed:
            return contextlib.nullcontext()
        from titan_dmuon import dmuon

        return dmuon.no_sync(self.model)

    def mean(self, loss: torch.Tensor) -> float:
        """The loss averaged over data-parallel ranks (what the reference's loss is)."""
        if not self.distributed:
            return loss.item()
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()


class _RefOptimizer:
    """torch.optim.Muon on the Muon matrices and AdamW on the rest, stepped and cleared together."""

    def __init__(self, model: nn.Module):
        self.muon, self.adamw = reference_optimizers(model, proj_predicate, **HP)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


Loop = Callable[[Side, int], list[float]]


@functools.cache
def reference(loop: Loop, n_dp: int, steps: int, prepare: Callable | None = None) -> dict:
    """`loop` in one process on the reference optimizers; its losses and final weights. Cached: the layouts with
    the same number of DP ranks share one reference run (read it, never change it)."""
    torch.manual_seed(0)
    model = LoopLlama()
    if prepare is not None:
        model = prepare(model)
    opt = _RefOptimizer(model)
    with fp32_torch_muon():
        losses = loop(Side(model, opt, n_dp, None), steps)
    module = getattr(model, "_orig_mod", model)
    return dict(losses=losses, sd={k: v.detach().clone() for k, v in module.state_dict().items()})


def _build(layout: str, block_units: bool = True):
    """LoopLlama on `layout` through DMuon's public API; (model to call, optimizer, dp rank, dp size).
    `block_units`: each block its own FSDP2 unit (the per-layer `fully_shard` loop), else the root unit only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    model = LoopLlama().to(device)
    shard = shard_blocks if block_units else (lambda m, mesh: fully_shard(m, mesh=mesh))
    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        dmuon.dedicate_params(model, mesh, proj_predicate)
        shard(model, mesh)
        dp_rank, n_dp = dist.get_rank(), world
    elif layout == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
        shard(model, mesh)
        dp_rank, n_dp = dist.get_rank(), world
    elif layout == "dp_tp":
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
        shard(model, mesh["dp"])
        dp_rank, n_dp = mesh.get_coordinate()[0], world // 2
    elif layout == "ddp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        dmuon.replicate(model, mesh)
        dp_rank, n_dp = dist.get_rank(), world
    else:
        raise ValueError(layout)
    return model, build_muon(model), dp_rank, n_dp


def _run_loops(rank: int, world_size: int, layout: str, loops: dict, steps: int, block_units: bool):
    from titan_dmuon import dmuon

    out = {}
    for name, (loop, prepare) in loops.items():
        model, opt, dp_rank, n_dp = _build(layout, block_units)
        called = prepare(model) if prepare is not None else model
        losses = loop(Side(called, opt, n_dp, dp_rank, module=model), steps)
        out[name] = dict(losses=losses, sd=dmuon.get_model_state_dict(model))
    return out


def run_layout(
    layout: str,
    loops: dict[str, tuple[Loop, Callable | None]],
    steps: int,
    block_units: bool = True,
    timeout: float = 240,
):
    """Every loop (name -> (loop, prepare: model -> the model the loop calls, or None)) on `layout`'s ranks;
    rank 0's {name: {losses, sd}}. A hang fails after `timeout` s with every rank's stack."""
    return run_distributed(_run_loops, LAYOUTS[layout], layout, loops, steps, block_units, timeout=timeout)[0]


def n_dp_of(layout: str) -> int:
    return {"fsdp": 2, "hsdp": 4, "dp_tp": 2, "ddp": 2}[layout]


def check_loops(
    layout: str,
    loops: dict[str, tuple[Loop, Callable | None]],
    steps: int,
    rtol: float = RTOL,
    block_units: bool = True,
) -> dict[str, float]:
    """Run `loops` on `layout` and in one process; assert every loss and every final weight within `rtol`
    (norm-wise relative); return each loop's largest relative error."""
    got = run_layout(layout, loops, steps, block_units)
    worst = {}
    for name, (loop, prepare) in loops.items():
        want = reference(loop, n_dp_of(layout), steps, prepare)
        errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got[name]["losses"], want["losses"], strict=True)]
        assert len(got[name]["losses"]) == len(want["losses"]) == steps, name
        assert set(got[name]["sd"]) == set(want["sd"]), name
        errs += [rel_err(got[name]["sd"][k], v) for k, v in want["sd"].items()]
        worst[name] = max(errs)
        print(f"loop {name} on {layout}: max relative error {worst[name]:.2e}")
        assert worst[name] <= rtol, f"{name} on {layout}: relative error {worst[name]:.3e} > {rtol:g}"
    return worst


# ---- loops every module shares ------------------------------------------------------------------------
def plain_loop(side: Side, steps: int, clear: Callable[[Side], None] | None = None) -> list[float]:
    """forward, backward, step, clear (default `optimizer.zero_grad()`)."""
    losses = []
    for step in range(steps):
        loss = side.loss(step)
        loss.backward()
        side.opt.step()
        (clear or (lambda s: s.opt.zero_grad()))(side)
        losses.append(side.mean(loss))
    return losses


def two_forwards_one_backward(side: Side, steps: int) -> list[float]:
    """Two forwards (each with its own skips), one backward of their mean."""
    losses = []
    for step in range(steps):
        loss = (side.loss(2 * step) + side.loss(2 * step + 1)) / 2
        loss.backward()
        side.opt.step()
        side.opt.zero_grad()
        losses.append(side.mean(loss))
    return losses
