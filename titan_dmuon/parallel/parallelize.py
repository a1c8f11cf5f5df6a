"""parallelize(model): TP -> activation checkpointing -> per-block torch.compile -> DMuon -> FSDP2.

The order matters:
  * TP first: it turns the block matrices into TP DTensors, and DMuon/FSDP2 then shard those.
  * AC and compile only change *how a block's forward body runs*, never the module tree: they replace the
    block's `forward` (an instance attribute) and keep the block itself at `layers.N`. So every parameter
    FQN stays `layers.N.attention.wq.weight` (the muon_params regex, DMuon's FQN-based hook boundary
    resolution and the state-dict keys all see plain FQNs), and the forward hooks of DMuon and FSDP2 on
    `layers.N` run outside the checkpointed/compiled region: in backward their pre-backward hook gathers the
    params before the recompute needs them, and no collective is ever traced by dynamo.
  * DMuon before FSDP2: `fully_shard` must skip the dedicated params (DMuon's FSDP2 patch), and
    `dedicate_params` refuses a model FSDP2 already owns.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from titan_dmuon.config import ConfigError, JobConfig

from .parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks (`model.layers`, a ModuleDict or ModuleList) as (FQN, module)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(
            f"parallelize expects a model with a `layers` ModuleDict/ModuleList of blocks, got {type(model).__name__}"
        )
    return [(f"layers.{name}", block) for name, block in layers.named_children()]


# ------------------------------------------------------------------------------------------------ TP
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, cfg: JobConfig, apply_tp: Callable) -> None:
    """The model family's TP plan (sequence parallel: the sequence must split evenly over the TP ranks)."""
    tp = tp_mesh.size()
    if cfg.training.seq_len % tp:
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) must be divisible by "
            f"parallelism.tensor_parallel_degree ({tp}) (sequence parallelism)"
        )
    try:
        apply_tp(model, tp_mesh)
    except ValueError as e:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} does not fit model {cfg.model.name}/{cfg.model.flavor}: {e}"
        ) from None


# ------------------------------------------------------------------------------------------------ AC
def _checkpointed(fn: Callable) -> Callable:
    def forward(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    forward.__wrapped__ = fn
    return forward


def apply_ac(model: nn.Module, mode: str) -> list[str]:
    """Activation checkpointing of whole blocks: "full" = every block, "selective" = every other block
    (layers 0, 2, 4, ...), "none". Returns the FQNs of the checkpointed blocks.

    Only the block's forward body is recomputed (non-reentrant `torch.utils.checkpoint`); the module stays
    at `layers.N`, so DMuon's and FSDP2's hooks on it are outside the checkpoint (see the module docstring).
    """
    if mode == "none":
        return []
    if mode not in ("selective", "full"):
        raise ValueError(f"activation checkpoint mode must be 'none', 'selective' or 'full', got {mode!r}")
    done = []
    for i, (fqn, block) in enumerate(_blocks(model)):
        if mode == "full" or i % 2 == 0:
            block.forward = _checkpointed(block.forward)
            done.append(fqn)
    logger.info("Activation checkpointing (%s): %d of %d blocks", mode, len(done), len(_blocks(model)))
    return done


# ------------------------------------------------------------------------------------------- compile
def apply_compile(model: nn.Module) -> None:
    """torch.compile each block's forward body (after AC, so a checkpointed body compiles as one region).

    The compiled function replaces `block.forward`; `block(...)` still runs the module's hooks eagerly.
    """
    for _, block in _blocks(model):
        block.forward = torch.compile(block.forward)
    logger.info("Compiled %d blocks with torch.compile", len(_blocks(model)))


# --------------------------------------------------------------------------------------------- DMuon
def muon_predicate(pattern: str) -> Callable[[str, nn.Parameter], bool]:
    """Muon params: 2D params whose FQN matches `pattern` (re.search; the default pattern is anchored)."""
    regex = re.compile(pattern)
    return lambda name, p: p.ndim == 2 and regex.search(name) is not None


def apply_dmuon(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, cfg: JobConfig, param_dtype: torch.dtype | None
) -> dict:
    """dmuon.dedicate_params over the shard slice (+ the replicate slice for HSDP). Returns the owners."""
    from titan_dmuon import dmuon

    try:
        owners = dmuon.dedicate_params(
            model,
            mesh["shard"],
            muon_predicate(cfg.optimizer.muon_params),
            replicate_mesh=mesh["replicate"] if dims.hsdp else None,
            reshard_after_forward=cfg.parallelism.dmuon_reshard_after_forward,
            param_dtype=param_dtype,
        )
    except ValueError as e:
        if "selected no 2D parameter" in str(e):
            raise ConfigError(
                f"optimizer.muon_params = {cfg.optimizer.muon_params!r} selects no 2D parameter "
                f"of {cfg.model.name}/{cfg.model.flavor}"
            ) from None
        raise
    logger.info("DMuon: %d matrices dedicated over %d owner slots", len(owners), dims.dp_world_size)
    return owners


# --------------------------------------------------------------------------------------------- FSDP2
def apply_fsdp(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: JobConfig,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> None:
    """fully_shard every block, then the root (embeddings, final norm, output), over the DP mesh.

    fsdp_reshard_after_forward: "default" reshards the blocks but not the root (the root's params are used
    again at the very start of backward), "always" reshards all, "never" none (ZeRO-2).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_mesh = dims.fsdp_mesh(mesh)
    mode = cfg.parallelism.fsdp_reshard_after_forward
    for _, block in _blocks(model):
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=mode != "never")
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=mode == "always")


def parallelize(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, cfg: JobConfig, apply_tp: Callable | None = None
) -> nn.Module:
    """TP (tp > 1) -> AC -> compile -> DMuon (optimizer "dmuon") -> FSDP2, in place; returns the model.

    The model must be materialized and initialized (identically on every rank) already: DMuon copies each
    owner's fp32 master out of the live values when it dedicates them. `apply_tp` is the model family's
    TP plan (default: models.llama3.apply_tp).
    """
    param_dtype = DTYPES[cfg.training.mixed_precision_param]
    reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
    if dims.tp_enabled:
        if apply_tp is None:
            from models.llama3 import apply_tp
        apply_tensor_parallel(model, mesh["tp"], cfg, apply_tp)
    apply_ac(model, cfg.activation_checkpoint.mode)
    if cfg.compile.enable:
        apply_compile(model)
    low_precision = param_dtype if param_dtype != torch.float32 else None
    if cfg.optimizer.name == "dmuon":
        apply_dmuon(model, dims, mesh, cfg, low_precision)
    apply_fsdp(
        model,
        dims,
        mesh,
        cfg,
        low_precision,
        reduce_dtype if (low_precision is not None or reduce_dtype != torch.float32) else None,
    )
    logger.info(
        "Parallelized: %s; optimizer %s; AC %s; compile %s",
        dims.describe(),
        cfg.optimizer.name,
        cfg.activation_checkpoint.mode,
        cfg.compile.enable,
    )
    return model
