"""`muon_naive`: FSDP2 + Muon the naive way, the baseline DMuon is compared against.

Every Muon matrix stays an FSDP2-sharded DTensor (TP-sharded too, with TP). At step time each rank
all-gathers each Muon grad (`full_tensor()`, over every mesh dim), keeps a full-size momentum buffer, runs
the same Newton-Schulz as every other rank, and applies its own shard of the update: N times the
Newton-Schulz work of DMuon and an all-gather of every Muon grad. The update is dmuon.Muon's for the same
options (the same Newton-Schulz and lr scaling functions), so the two train the same model; with
`per_head` it orthogonalizes each head block of the full matrix on its own and scales its lr by the block's
shape, as dmuon.Muon does. An expert stack (a 3D param, experts x out x in) is orthogonalized expert by
expert, as dmuon.Muon does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_dmuon import dmuon

from .base import OptimizerComponent, muon_options, register_optimizer


class NaiveMuon(torch.optim.Optimizer):
    """Muon on (FSDP2/TP-sharded) matrices by gathering each grad and orthogonalizing it on every rank; AdamW
    (torch's functional kernel, foreach) on the other params.

    Takes the same options as dmuon.Muon (a `dmuon.MuonOptions` and/or its fields by keyword, the same defaults;
    `ns_max_batch_elements` has no effect: each matrix runs alone) and the same `adamw_*` arguments. Param groups
    carry `kind` "muon" or "adamw" like dmuon.Muon's, so one lr scheduler scales both. `last_step_stats` holds
    this rank's Newton-Schulz calls and time and the bytes it received all-gathering the grads.

    `head_blocks` maps a Muon param to its `(dim, size)` head blocks (what `dmuon.dedicate_params` takes by FQN):
    with `per_head` each block of the full matrix is orthogonalized on its own (one NS call per block) and its
    lr scaled by the block's shape (`per_head_wo` for the column blocks, dim 1), as dmuon.Muon does.

    `qk_clip_tau` is not applied here (it needs the model's attention layers): the component's QK-clip runs after
    `step` (OptimizerComponent.attach_qk_clip).
    """

    def __init__(
        self,
        muon_params: Sequence[nn.Parameter],
        adamw_params: Sequence[nn.Parameter],
        options: dmuon.MuonOptions | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        head_blocks: Mapping[nn.Parameter, tuple[int, int]] | None = None,
        **muon_options: Any,
    ):
        self.options = dmuon.MuonOptions.of(options, **muon_options)
        if self.options.per_head and not head_blocks:
            raise dmuon.OptionError("per_head", "is set but NaiveMuon got no head_blocks ({param: (dim, size)})")
        self.head_blocks: dict[nn.Parameter, tuple[int, int]] = {}
        for p, blocks in (head_blocks or {}).items():
            dim, size = blocks
            if dim not in (0, 1) or size < 1 or p.shape[dim] % size:
                raise ValueError(f"head blocks {blocks!r} do not split a matrix of shape {tuple(p.shape)}")
            if self.options.active_blocks(blocks) is not None:
                self.head_blocks[p] = (dim, size)
        muon = dict(kind="muon", **self.options.group_defaults())
        adamw = dict(
            kind="adamw", lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        groups = [{"params": list(ps), **opts} for ps, opts in ((adamw_params, adamw), (muon_params, muon)) if ps]
        super().__init__(groups, {})
        self.last_step_stats: dict[str, float] = {}

    # The optimizer-wide NS settings, as attributes (read-only: they are `options`').
    ns_dtype = property(lambda self: self.options.ns_dtype, doc="MuonOptions.ns_dtype (None: the device's default).")
    ns_formulation = property(lambda self: self.options.ns_formulation, doc="MuonOptions.ns_formulation.")
    kernel = property(lambda self: self.options.kernel, doc="MuonOptions.kernel.")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = {"ns_calls": 0.0, "ns_time_s": 0.0, "bytes_all_gather": 0.0}
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
            else:
                for p in group["params"]:  # the same order on every rank: the all-gathers match
                    if p.grad is not None:
                        self._muon_update(p, group, stats)
        self.last_step_stats = stats
        return loss

    def _muon_update(self, p: nn.Parameter, opts: dict, stats: dict[str, float]) -> None:
        """Momentum and Newton-Schulz on the full matrix (every rank alike), then this rank's shard of it."""
        grad = p.grad
        if isinstance(grad, DTensor):
            local_numel = grad.to_local().numel()
            grad = grad.full_tensor()  # the all-gather DMuon never does
            stats["bytes_all_gather"] += (grad.numel() - local_numel) * grad.element_size()
        update = dmuon.momentum_update(grad, self.state[p], opts)  # the same rule as dmuon.Muon's
        kwargs = self.options.ns_kwargs(opts, update.device)
        shape = list(p.shape)  # the shape the lr is scaled by: the matrix's, or one head block's
        t0 = time.perf_counter()
        if update.dim() == 3:  # an expert stack: each expert's matrix on its own, lr scaled by its shape
            shape = shape[1:]
            ortho = torch.stack([dmuon.zeropower_via_newtonschulz(e, **kwargs) for e in update.unbind(0)])
        elif p in self.head_blocks:  # per head: each block of the full matrix on its own
            dim, size = self.head_blocks[p]
            shape[dim] = size
            blocks = update.split(size, dim=dim)
            ortho = torch.cat([dmuon.zeropower_via_newtonschulz(b, **kwargs) for b in blocks], dim=dim)
        else:
            ortho = dmuon.zeropower_via_newtonschulz(update, **kwargs)
        stats["ns_time_s"] += time.perf_counter() - t0
        stats["ns_calls"] += 1
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor):  # this rank's piece, for any placement (no communication)
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local.mul_(1 - opts["lr"] * opts["weight_decay"])
        local.add_(ortho.to(local.dtype), alpha=-dmuon.adjusted_lr(opts["lr"], opts["adjust_lr_fn"], shape))

    def _adamw_step(self, group: dict) -> None:
        dmuon.adamw_step(group, self.state)


@register_optimizer
class MuonNaive(OptimizerComponent):
    """NaiveMuon over the FSDP2-sharded model, with `[optimizer.muon]` and `[optimizer.adamw]`; the base
    class's FSDP2 defaults do the rest."""

    name = "muon_naive"

    def prepare(self, model, dims, mesh) -> set[nn.Parameter]:
        self.select_muon_params(model)  # a ConfigError naming the regex when it selects nothing
        self.head_blocks(model)  # a ConfigError when per_head is on and the family has no head blocks
        return super().prepare(model, dims, mesh)

    def build(self) -> torch.optim.Optimizer:
        selected = self.select_muon_params(self.model)  # FSDP2's params now: select again
        muon = {id(p) for _, p in selected}
        blocks = self.head_blocks(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = NaiveMuon(
            [p for p in params if id(p) in muon],
            [p for p in params if id(p) not in muon],
            head_blocks={p: blocks[n] for n, p in selected if n in blocks},
            **muon_options(self.cfg),
        )
        return self.optimizer

    def step_stats(self) -> dict[str, float]:
        """Newton-Schulz calls and time, and the Muon-grad all-gather bytes when there is more than one rank:
        `muon_naive/<name>` the max over ranks, `muon_naive_mean/<name>` the mean (one all_gather; log steps only)."""
        stats = self.optimizer.last_step_stats
        keys = ("ns_calls", "ns_time_s", "bytes_all_gather") if self.dims.world_size > 1 else ("ns_calls", "ns_time_s")
        return {**self.over_ranks("muon_naive", {k: float(v) for k, v in stats.items()}, keys), **super().step_stats()}
