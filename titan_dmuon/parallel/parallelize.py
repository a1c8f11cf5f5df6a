"""parallelize(model): TP -> activation checkpointing -> per-block torch.compile -> optimizer prepare -> FSDP2,
all on the meta device (nothing is allocated until `materialize`).

The model family's ModelSpec says where the blocks are and what the TP plan is; the optimizer component
says which params FSDP2 must leave alone. The order matters:
  * TP first: it turns the block matrices into TP DTensors, and the optimizer/FSDP2 then shard those.
  * AC and compile only change *how a block's forward body runs*, never the module tree: they replace the
    block's `forward` (an instance attribute) and keep the block module where it is. So every parameter
    FQN stays the same (the muon_params regex, DMuon's hook boundaries and the state-dict keys all see plain
    FQNs), and the forward hooks DMuon and FSDP2 put on a block run outside the checkpointed/compiled
    region: in backward their pre-backward hook gathers the params before the recompute needs them, and no
    collective is ever traced by dynamo.
  * The optimizer's prepare (DMuon dedicates its matrices there) before FSDP2: `fully_shard` gets those
    params as `ignored_params`, and `dmuon.dedicate_params` refuses a model FSDP2 already owns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from titan_dmuon.config import ConfigError, JobConfig

from .parallel_dims import ParallelDims

if TYPE_CHECKING:
    from collections.abc import Callable

    from titan_dmuon.components.model import ModelSpec
    from titan_dmuon.components.optimizer import OptimizerComponent

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Blocks = list[tuple[str, nn.Module]]


# ------------------------------------------------------------------------------------------------ TP
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, cfg: JobConfig, spec: ModelSpec) -> None:
    """The model family's TP plan (sequence parallel: the sequence must split evenly over the TP ranks)."""
    tp = tp_mesh.size()
    if spec.apply_tp is None:
        raise ConfigError(f"parallelism.tensor_parallel_degree = {tp}: model family {spec.name} has no TP plan")
    if cfg.training.seq_len % tp:
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) must be divisible by "
            f"parallelism.tensor_parallel_degree ({tp}) (sequence parallelism)"
        )
    try:
        spec.apply_tp(model, tp_mesh)
    except ValueError as e:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} does not fit model {spec.name}/{cfg.model.flavor}: {e}"
        ) from None


# ------------------------------------------------------------------------------------------------ AC
def _checkpointed(fn: Callable) -> Callable:
    def forward(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    forward.__wrapped__ = fn
    return forward


def apply_ac(blocks: Blocks, mode: str) -> list[str]:
    """Activation checkpointing of whole blocks: "full" = every block, "selective" = every other block
    (blocks 0, 2, 4, ...), "none". Returns the FQNs of the checkpointed blocks.

    Only the block's forward body is recomputed (non-reentrant `torch.utils.checkpoint`); the module stays
    where it is, so DMuon's and FSDP2's hooks on it are outside the checkpoint (see the module docstring).
    """
    if mode == "none":
        return []
    if mode not in ("selective", "full"):
        raise ValueError(f"activation checkpoint mode must be 'none', 'selective' or 'full', got {mode!r}")
    done = []
    for i, (fqn, block) in enumerate(blocks):
        if mode == "full" or i % 2 == 0:
            block.forward = _checkpointed(block.forward)
            done.append(fqn)
    logger.info("Activation checkpointing (%s): %d of %d blocks", mode, len(done), len(blocks))
    return done


# ------------------------------------------------------------------------------------------- compile
def apply_compile(blocks: Blocks) -> None:
    """torch.compile each block's forward body (after AC, so a checkpointed body compiles as one region).

    The compiled function replaces `block.forward`; `block(...)` still runs the module's hooks eagerly.
    """
    for _, block in blocks:
        block.forward = torch.compile(block.forward)
    logger.info("Compiled %d blocks with torch.compile", len(blocks))


# --------------------------------------------------------------------------------------------- FSDP2
MIN_BLOCK_UNIT_FRACTION = 0.01
"""A block is an FSDP2 unit of its own only while FSDP2 still shards at least this fraction of its params.
With DMuon a Llama block keeps only its two norm vectors (2·dim of ~12·dim² elements): as a unit it would
cost an all-gather in forward, another in backward and a reduce-scatter per block per step, each a fixed
collective latency for a few KB. Left to the root unit they are gathered with the embeddings, once per step
(twice with fsdp_reshard_after_forward = "always"): all blocks' norms, 2·dim·n_layers elements (4.1M at 405B),
unsharded from forward to the end of backward."""


def fsdp_blocks(blocks: Blocks, ignored_params: set[nn.Parameter]) -> list[nn.Module]:
    """The blocks worth their own FSDP2 unit: those whose params outside `ignored_params` are at least
    MIN_BLOCK_UNIT_FRACTION of their params (every block when nothing is ignored)."""
    out = []
    for _, block in blocks:
        sizes = [(p.numel(), p in ignored_params) for p in block.parameters()]
        kept = sum(n for n, ign in sizes if not ign)
        if kept and kept >= MIN_BLOCK_UNIT_FRACTION * sum(n for n, _ in sizes):
            out.append(block)
    return out


def apply_fsdp(
    model: nn.Module,
    blocks: Blocks,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: JobConfig,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """fully_shard the blocks that keep >= 1% of their params for FSDP2 (`fsdp_blocks`), then the root (embeddings,
    final norm, output, and the params of any other block), over the DP mesh, leaving `ignored_params` (the
    optimizer's own, e.g. DMuon's dedicated matrices) to their owner.

    fsdp_reshard_after_forward: "default" reshards the blocks but not the root (the root's params are used
    again at the very start of backward), "always" reshards all, "never" none (ZeRO-2).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block unit does not cast its inputs: the hidden state already comes in param_dtype from the embedding,
    # and the other input, the RoPE table, stays fp32 (as torchtitan's complex table, which FSDP2 never casts),
    # whether the block is a unit or not (under DMuon it is not).
    block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    fsdp_mesh = dims.fsdp_mesh(mesh)
    mode = cfg.parallelism.fsdp_reshard_after_forward
    ignored = ignored_params or None
    units = fsdp_blocks(blocks, ignored_params or set())
    if len(units) < len(blocks):
        logger.info(
            "FSDP2: %d of %d blocks are units of their own; the other blocks keep under %.0f%% of their params "
            "once the optimizer's are set aside, and the root unit gathers those",
            len(units),
            len(blocks),
            100 * MIN_BLOCK_UNIT_FRACTION,
        )
    for block in units:
        fully_shard(
            block, mesh=fsdp_mesh, mp_policy=block_mp, reshard_after_forward=mode != "never", ignored_params=ignored
        )
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=mode == "always", ignored_params=ignored)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: JobConfig,
    spec: ModelSpec,
    optimizer: OptimizerComponent,
) -> nn.Module:
    """TP (tp > 1) -> AC -> compile -> optimizer.prepare -> FSDP2, in place; returns the model.

    Runs on the meta model (the trainer then calls `materialize`, which allocates and initializes each rank's
    share; the dry-run planner stops here). It also works on a materialized model: DMuon then copies each
    owner's fp32 master out of the live values.
    """
    param_dtype = DTYPES[cfg.training.mixed_precision_param]
    reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
    if dims.tp_enabled:
        apply_tensor_parallel(model, mesh["tp"], cfg, spec)
    blocks = spec.blocks(model)
    apply_ac(blocks, cfg.activation_checkpoint.mode)
    if cfg.compile.enable:
        apply_compile(blocks)
    ignored = optimizer.prepare(model, dims, mesh)
    low_precision = param_dtype if param_dtype != torch.float32 else None
    apply_fsdp(
        model,
        blocks,
        dims,
        mesh,
        cfg,
        low_precision,
        reduce_dtype if (low_precision is not None or reduce_dtype != torch.float32) else None,
        ignored,
    )
    logger.info(
        "Parallelized: %s; optimizer %s (%d params outside FSDP2); AC %s; compile %s",
        dims.describe(),
        optimizer.name,
        len(ignored),
        cfg.activation_checkpoint.mode,
        cfg.compile.enable,
    )
    return model
