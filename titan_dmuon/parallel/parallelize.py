"""parallelize(model): TP -> EP -> activation checkpointing -> per-block torch.compile -> optimizer prepare -> FSDP2,
all on the meta device (nothing is allocated until `materialize`).

The model family's ModelSpec says where the blocks are and what the TP plan is; the optimizer component
says which params FSDP2 must leave alone. The order matters:
  * TP first: it turns the block matrices into TP DTensors, and the optimizer/FSDP2 then shard those.
  * EP next (parallelism.expert_parallel_degree, expert_parallel.py): the expert stacks become DTensors sharded on
    the expert dim over dims.meshes.ep and the MoE layers route tokens by all-to-all; the optimizer (DMuon's
    expert_mesh) or FSDP2 (a unit per expert stack, over the expert-DP mesh) then shards them again.
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

from titan_dmuon import dmuon
from titan_dmuon.config import ActivationCheckpoint, ConfigError, JobConfig
from titan_dmuon.dtypes import to_dtype

from .expert_parallel import apply_ep, expert_modules
from .parallel_dims import ParallelDims

if TYPE_CHECKING:
    from collections.abc import Callable

    from titan_dmuon.components.model import ModelSpec
    from titan_dmuon.components.optimizer import OptimizerComponent

logger = logging.getLogger(__name__)


Blocks = list[tuple[str, nn.Module]]


# ------------------------------------------------------------------------------------------------ TP
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, cfg: JobConfig, spec: ModelSpec) -> None:
    """The model family's TP plan (sequence parallel: the sequence must split evenly over the TP ranks), with loss
    parallelism unless `parallelism.disable_loss_parallel` (the trainer's `_loss` then runs the cross-entropy on
    the vocab-sharded logits)."""
    tp = tp_mesh.size()
    if spec.apply_tp is None:
        raise ConfigError(f"parallelism.tensor_parallel_degree = {tp}: model family {spec.name} has no TP plan")
    if cfg.training.seq_len % tp:
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) must be divisible by "
            f"parallelism.tensor_parallel_degree ({tp}) (sequence parallelism)"
        )
    try:
        spec.apply_tp(model, tp_mesh, loss_parallel=not cfg.parallelism.disable_loss_parallel)
    except ValueError as e:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} does not fit model {spec.name}/{cfg.model.flavor}: {e}"
        ) from None


# ------------------------------------------------------------------------------------------------ AC
def _checkpointed(fn: Callable, context_fn: Callable | None = None) -> Callable:
    def forward(*args, **kwargs):
        if context_fn is None:
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    forward.__wrapped__ = fn
    return forward


def _sac_save_ops() -> set:
    """The ops whose outputs op-level selective AC keeps: matmuls (every other one) and attention (each SDPA
    kernel torch may pick: flash, memory-efficient, cuDNN, the CPU one). Everything else is recomputed."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return {aten.mm.default} | {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _op_sac_context() -> tuple:
    """One checkpoint call's contexts for op-level selective AC: save the SDPA outputs and the 1st, 3rd, ... matmul
    of the block (for a Llama block wq, wv, w1, w2), recompute the rest. The forward and its recompute count their
    matmuls separately, so both make the same choice for the same matmul."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, mm = _sac_save_ops(), torch.ops.aten.mm.default
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func is mm:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def ac_plan(mode: str, option: str, n_blocks: int) -> tuple[list[int], bool]:
    """(indices of the blocks to checkpoint, whether op-level) for `activation_checkpoint.mode` / `selective_ac_option`:
    "full": every block whole; "selective" with "op": every block, op-level; with n: blocks 0, n, 2n, ... whole."""
    if mode == "none":
        return [], False
    if mode == "full":
        return list(range(n_blocks)), False
    ActivationCheckpoint(mode=mode, selective_ac_option=option).validate()  # the section's ConfigError, if any
    if option == "op":
        return list(range(n_blocks)), True
    return list(range(0, n_blocks, int(option))), False


def apply_ac(blocks: Blocks, mode: str, option: str = "2") -> list[str]:
    """Activation checkpointing of the blocks (`ac_plan`); returns the FQNs of the checkpointed blocks.

    Only the block's forward body is recomputed (non-reentrant `torch.utils.checkpoint`, op-level through a
    selective-checkpoint policy); the module stays where it is, so DMuon's and FSDP2's hooks on it are outside the
    checkpoint (see the module docstring).
    """
    chosen, per_op = ac_plan(mode, option, len(blocks))
    done = []
    for i in chosen:
        fqn, block = blocks[i]
        block.forward = _checkpointed(block.forward, _op_sac_context if per_op else None)
        done.append(fqn)
    if mode != "none":
        what = "op-level" if per_op else "whole blocks"
        logger.info("Activation checkpointing (%s, %s): %d of %d blocks", mode, what, len(done), len(blocks))
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
MIN_BLOCK_UNIT_FRACTION = dmuon.units.MIN_UNIT_FRACTION
"""A block is an FSDP2 unit of its own only while FSDP2 still shards at least this fraction of its params (the
library's rule: `dmuon.fsdp_units`, which says why)."""


def fsdp_blocks(blocks: Blocks, ignored_params: set[nn.Parameter]) -> list[nn.Module]:
    """The blocks worth their own FSDP2 unit (`dmuon.fsdp_units`): those whose params outside `ignored_params`
    (and outside DMuon's dedicated ones) are at least MIN_BLOCK_UNIT_FRACTION of their params (every block when
    nothing is ignored)."""
    return dmuon.fsdp_units(None, [b for _, b in blocks], ignored_params=ignored_params)


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
    if len(units) < len(blocks) and dims.dp_shard > 1:  # with one shard there is no sharding to speak of
        logger.info(
            "FSDP2: %d of %d blocks are units of their own; the other blocks keep under %.0f%% of their params "
            "once the optimizer's are set aside, and the root unit gathers those",
            len(units),
            len(blocks),
            100 * MIN_BLOCK_UNIT_FRACTION,
        )
    if dims.ep_enabled:  # expert stacks (not the optimizer's): units of their own over the expert-DP mesh
        for experts in expert_modules(model):
            if ignored_params and all(p in ignored_params for p in experts.parameters()):
                continue
            fully_shard(
                experts, mesh=dims.expert_fsdp_mesh(mesh), mp_policy=block_mp, reshard_after_forward=mode != "never"
            )
            # an expert's grad on its EP rank already sums every rank's tokens: divide by all DP ranks, not the
            # expert-DP ranks FSDP2 reduces over
            experts.set_gradient_divide_factor(float(dims.dp_world_size))
            # gloo has no PREMUL_SUM: sum, then divide (FSDP2 would divide twice on a 1-rank reduce-scatter group)
            if mesh.device_type != "cuda" and dims.expert_shard_size > 1:
                experts.set_force_sum_reduction_for_comms(True)
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
    *,
    whole_model_has_moe: bool | None = None,
) -> nn.Module:
    """TP (tp > 1) -> EP (ep > 1) -> AC -> compile -> optimizer.prepare -> FSDP2, in place; returns the model.

    Runs on the meta model (the trainer then calls `materialize`, which allocates and initializes each rank's
    share; the dry-run planner stops here). It also works on a materialized model: DMuon then copies each
    owner's fp32 master out of the live values.

    `whole_model_has_moe`: whether the whole model has MoE layers, when `model` is a pipeline stage's part (the
    trainer and the dry-run planner pass it). A stage may hold none (DeepSeek-V3's dense first layers): it then has
    nothing to shard over EP, which is no error, and every stage raises the same config errors. Without it `model`
    is taken for the whole model.
    """
    param_dtype = to_dtype(cfg.training.mixed_precision_param)
    reduce_dtype = to_dtype(cfg.training.mixed_precision_reduce)
    has_moe = bool(expert_modules(model)) if whole_model_has_moe is None else whole_model_has_moe
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.meshes.tp, cfg, spec)
    if dims.tp_enabled and not dims.ep_enabled and has_moe:
        # under sequence parallelism each TP rank routes its own tokens through whole experts: their grads must be
        # summed over TP, which the expert-data-parallel mesh (efsdp x tp) does and only EP builds
        raise ConfigError(
            f"{cfg.model.name}/{cfg.model.flavor} has Mixture-of-Experts layers: under tensor parallelism they need "
            "expert parallelism too: set parallelism.expert_parallel_degree >= 2 (it divides the shard degree)"
        )
    if dims.ep_enabled and apply_ep(model, dims.meshes.ep) == 0 and not has_moe:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {dims.ep}, but {cfg.model.name}/{cfg.model.flavor} has no "
            "Mixture-of-Experts layer: use an MoE flavor (e.g. qwen3 debugmodel_moe) or expert_parallel_degree = 1"
        )
    blocks = spec.blocks(model)
    apply_ac(blocks, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
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
