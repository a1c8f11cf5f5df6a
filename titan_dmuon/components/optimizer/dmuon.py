"""`dmuon`: Muon by dedicated ownership (titan_dmuon.dmuon) on the Muon matrices, AdamW on the rest.

prepare() dedicates the Muon matrices (each to one owner rank, on the meta model: ownership only) before FSDP2
shards the rest, and returns them so that fully_shard ignores them; init_own_params() has each owner column
allocate and fill its fp32 masters; every later call goes through dmuon's public API.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_dmuon import dmuon
from titan_dmuon.dmuon.comm import KINDS, WaitMeter

from .base import OptimizerComponent, muon_options, register_optimizer

if TYPE_CHECKING:
    from titan_dmuon.parallel import ParallelDims

logger = logging.getLogger(__name__)


def _axis_of(kind: str) -> str:
    """The mesh axis a ledger kind moves data over (docs/dmuon.md, "Bytes per step")."""
    if kind.startswith("replicate_"):
        return "replicate"
    if kind.startswith("tp_"):
        return "tp"
    return "shard"


@register_optimizer
class DMuon(OptimizerComponent):
    """dmuon.dedicate_params + dmuon.Muon, with `[optimizer.muon]`, `[optimizer.adamw]` and `[optimizer.dmuon]`."""

    name = "dmuon"
    planned = True

    def prepare(self, model: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> set[nn.Parameter]:
        super().prepare(model, dims, mesh)
        self.select_muon_params(model)  # a ConfigError naming the regex when it selects nothing
        blocks = {id(block) for _, block in self.spec.blocks(model)}
        t = self.cfg.training
        param_dtype = dmuon.to_dtype(t.mixed_precision_param) if t.mixed_precision_param != "float32" else None
        owners = dmuon.dedicate_params(
            model,
            dims.shard_mesh(mesh),
            self.muon_predicate,
            replicate_mesh=mesh["replicate"] if dims.hsdp else None,
            reshard_after_forward=self.cfg.optimizer.dmuon.reshard_after_forward,
            # one packed broadcast/reduce per block (FSDP2 leaves the blocks to its root unit: fsdp_blocks)
            hook_boundary_predicate=lambda m: id(m) in blocks or m is model,
            param_dtype=param_dtype,
            reduce_dtype=dmuon.to_dtype(t.mixed_precision_reduce),  # as FSDP2's reduce_dtype
            head_blocks=self.head_blocks(model) or None,  # optimizer.muon.per_head: the family's head blocks
            # expert parallelism: the expert stacks are owned over the ranks that hold the same experts
            expert_mesh=dims.expert_dp_mesh(mesh) if dims.ep_enabled else None,
            allow_empty=self.pipelined,  # a pipeline stage without a Muon matrix: AdamW only, same collectives
        )
        if self.pipelined:  # the stages' microbatches interleave: no group's successor is known (dmuon/state.py)
            dmuon.state_of(model, "prepare").prefetch = False
        self.own_params = set(owners)
        return self.own_params

    def init_own_params(self, init_fn, device) -> None:
        dmuon.init_dedicated_params(self.model, init_fn, device)  # each owner column's fp32 masters only

    def build(self) -> torch.optim.Optimizer:
        d = self.cfg.optimizer.dmuon
        self.optimizer = dmuon.Muon(
            self.model,
            **muon_options(self.cfg),
            replicate_async=d.replicate_async,
            tp_distributed_gram=d.tp_distributed_gram,
            tp_distributed_gram_policy=d.tp_distributed_gram_policy,
            tp_gather=d.tp_gather,
        )
        opt = self.optimizer  # what NS will run as, once at start-up (the kernel "auto" resolves to, the dtype)
        device = next(self.model.parameters()).device
        logger.info("DMuon: %s", dmuon.get_ns_backend(device, opt.ns_dtype, opt.kernel, opt.ns_formulation))
        tp_paths = dmuon.describe_tp_paths(self.model, opt)  # each TP matrix's path (local/gram/gather) and why
        if tp_paths:
            logger.info("%s", tp_paths)
        return self.optimizer

    def no_sync(self):
        return dmuon.no_sync(self.model)  # DMuon's reduces and FSDP2's

    def reduce_grads(self) -> None:
        dmuon.reduce_grads(self.model)  # to the owners, then FSDP2's reduce-scatter
        super().reduce_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return dmuon.clip_grad_norm_(self.model, self.optimizer, max_norm, pp_mesh=self.pp_mesh)

    def step_stats(self) -> dict[str, float]:
        """Newton-Schulz calls and time, the bytes of each collective kind whose mesh axis has more than one
        rank (the others are zero by construction), and, under HSDP with the async publish, how long the forwards
        since the last call waited for it (`publish_wait_p50_us`, `_p90_us`, `_p99_us`; docs/dmuon.md, "CUDA
        streams"): each rank's figures, as `dmuon/<name>` the max over ranks and `dmuon_mean/<name>` the mean
        (one all_gather, on log steps only: the trainer calls this there)."""
        stats = self.optimizer.last_step_stats
        values = {k: float(stats[k]) for k in ("ns_calls", "ns_time_s") if k in stats}
        values.update(self.optimizer.publish_wait_stats())
        degree = {"shard": self.dims.dp_shard, "replicate": self.dims.dp_replicate, "tp": self.dims.tp}
        kinds = [
            kind
            for kind in KINDS
            if degree[_axis_of(kind)] > 1 and (kind != "tp_gram" or self.cfg.optimizer.dmuon.tp_distributed_gram)
        ]
        values.update({f"bytes_{k}": float(v) for k, v in dmuon.comm_stats(self.model)["bytes"].items()})
        # The same keys, in the same order, on every rank (a figure a rank lacks is NaN in the gathered vector).
        keys = [
            "ns_calls",
            "ns_time_s",
            *(f"publish_wait_p{q}_us" for q in WaitMeter.QUANTILES),
            "publish_waits",
            *(f"bytes_{kind}" for kind in kinds),
        ]
        return {**self.over_ranks("dmuon", values, keys), **super().step_stats()}

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's share: each dedicated matrix's fp32 master on its owner's column only, the FSDP2 DTensors."""
        return dmuon.get_model_state_dict(self.model, full_state_dict=False)

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        dmuon.set_model_state_dict(self.model, state_dict, full_state_dict=False)

    def state_dict(self) -> dict[str, Any]:
        """This rank's share: Muon momentum on each matrix's owner only, AdamW moments as FSDP2 DTensors."""
        return dmuon.get_optimizer_state_dict(self.model, self.optimizer, full_state_dict=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dmuon.set_optimizer_state_dict(self.model, self.optimizer, state_dict, full_state_dict=False)

    def close(self) -> None:
        if self.model is not None and self.optimizer is not None:
            dmuon.drain(self.model)  # an HSDP publish or a deferred TP update may still be in flight
