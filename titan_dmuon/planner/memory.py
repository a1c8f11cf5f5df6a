"""Every rank's memory for a parallelized (meta) model, and whether the largest (or a given) rank fits its device.

Resident: FSDP2's param shards, DMuon's fp32 masters (every rank of an owner column), Muon's momentum (the global
owners), AdamW's two moments per FSDP2 element, the gradients (FSDP2 shards and the owners' fp32 reduced grads).
Transient: DMuon's packed buffers at their peak (`packed_peak`), FSDP2's root unit gathered whole, and the model
family's activation estimate. A rank's FSDP2 shard of a param is public arithmetic at its mesh coordinate
(`fsdp_local_numel`): TP and EP shard their dims as torch.chunk does, then FSDP2 cuts dim 0 of that local tensor
in chunks of ceil(rows / shard ranks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from titan_dmuon import dmuon
from titan_dmuon.components.model import ModelSpec
from titan_dmuon.config import JobConfig
from titan_dmuon.dtypes import to_dtype
from titan_dmuon.parallel import ParallelDims, fsdp_blocks
from titan_dmuon.parallel.expert_parallel import expert_modules

from .settings import CommSettings
from .summary import GIB, summary

MEMORY_TERMS = (
    ("fsdp_param_shards", "FSDP2 param shards"),
    ("dmuon_fp32_masters", "DMuon fp32 masters"),
    ("muon_momentum", "Muon momentum"),
    ("adamw_moments", "AdamW moments"),
    ("gradients", "gradients"),
    ("dmuon_packed_transient_peak", "DMuon packed buffers"),
    ("fsdp_root_unsharded", "FSDP2 root unit, gathered (params and grads)"),
)
ACTIVATION_TERMS = {
    "blocks": "activations kept by the blocks",
    "head": "activations of the head (norm, loss)",
    "head_backward": "the logits' grads at the start of backward",
    "recompute": "a checkpointed block being recomputed",
}
WARN_FRACTION = 0.9

# The mesh axes FSDP2 shards over (ParallelDims' names: the dense params' shard axis, the expert stacks' expert
# shard axis, efsdp on its own): FSDP2 cuts dim 0 of the local tensor the other axes (TP, EP) leave.
FSDP_SHARD_AXES = frozenset({"shard", "efsdp", "expert_shard"})


@dataclass(frozen=True)
class Placement:
    """What `plan_memory` learned of a build that the LPT plan and the bytes per step reuse: the degrees and every
    rank's coordinates, DMuon's matrices, and FSDP2's elements per rank."""

    dims: ParallelDims
    coords: dict[str, np.ndarray]  # ParallelDims.coordinates(), computed once
    matrices: list[dmuon.costs.Matrix]
    z3: bool  # DMuon-Z3 (optimizer.dmuon.reshard_after_forward) or Z2
    param_itemsize: int  # training.mixed_precision_param
    reduce_itemsize: int  # training.mixed_precision_reduce
    fsdp_numel: np.ndarray  # per rank: the elements of its FSDP2-managed local tensors
    fsdp_root_numel: np.ndarray  # of those, outside the FSDP2 units (the root unit's)


# ---------------------------------------------------------------------------------------------- activations
def activation_estimate(spec: ModelSpec, model: torch.nn.Module, cfg: JobConfig, tp: int, **overrides):
    """The model family's activation estimate for this config (`overrides` replace its arguments), or None."""
    if spec.activation_estimate is None:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint
    kwargs = dict(
        batch=t.local_batch_size,
        seq_len=t.seq_len,
        dtype_bytes=to_dtype(t.mixed_precision_param).itemsize,
        tp=tp,
        ac_mode=ac.mode,
        ac_option=ac.selective_ac_option,
        loss_parallel=not cfg.parallelism.disable_loss_parallel,
    )
    return spec.activation_estimate(model, **{**kwargs, **overrides})


def pipeline_activations(spec: ModelSpec, model: torch.nn.Module, cfg: JobConfig, dims: ParallelDims, pp_rank: int):
    """The activation estimate of a rank: without a pipeline its micro-batch's; under one, a microbatch's
    (pipeline_parallel_microbatch_size rows) times the microbatches the schedule keeps in flight on pp rank
    `pp_rank` (titan_dmuon/planner/pipeline.py), for the blocks and the head this rank's part holds."""
    if not dims.pp_enabled:
        return activation_estimate(spec, model, cfg, dims.tp)
    from titan_dmuon.parallel.pipeline import plan_stages, stage_ids, stage_slices

    from .pipeline import held_terms

    p, t = cfg.parallelism, cfg.training
    mb = p.pipeline_parallel_microbatch_size
    estimate = activation_estimate(spec, model, cfg, dims.tp, batch=mb)
    if estimate is None:
        return None
    n_layers = int(getattr(getattr(model, "args", None), "n_layers", 0)) or len(spec.blocks(model))
    stages = plan_stages(cfg, n_layers)
    mine = stage_slices(stages, stage_ids(pp_rank, dims.pp, len(stages), p.pipeline_parallel_schedule))
    per_block = estimate.blocks / max(estimate.layers, 1)
    weights = {s.index: (per_block * len(s.layers), estimate.head if s.head else 0.0) for s in mine}
    m = t.local_batch_size * t.gradient_accumulation_steps // mb
    blocks, head = held_terms(p.pipeline_parallel_schedule, dims.pp, pp_rank, m, weights)
    k = blocks / estimate.blocks if estimate.blocks else 0.0
    return dataclasses.replace(
        estimate, block=estimate.block * k, checkpointed_block=estimate.checkpointed_block * k, head=head
    )


def ac_label(cfg: JobConfig) -> str:
    ac = cfg.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode
    return "selective (op)" if ac.selective_ac_option == "op" else f"selective (every {ac.selective_ac_option})"


def _activation_terms(estimate) -> dict[str, float]:
    return {k: float(getattr(estimate, k)) for k in ACTIVATION_TERMS} | {"total": float(estimate.total)}


# ------------------------------------------------------------------------------------------------- capacity
def _capacity(memory: dict, rank: int, device: float) -> dict[str, Any]:
    """Whether `rank`'s planned peak fits `device` bytes, and its largest terms."""
    peak = memory["peak_estimate"]["per_rank"][rank]
    terms = [(label, memory[key]["per_rank"][rank]) for key, label in MEMORY_TERMS]
    if memory["activation_terms"] is not None:
        act = memory["activation_terms"]
        terms += [(ACTIVATION_TERMS["blocks"], act["blocks"])]
        terms += [(ACTIVATION_TERMS["head"], act["head"]), (ACTIVATION_TERMS["head_backward"], act["head_backward"])]
        terms += [(ACTIVATION_TERMS["recompute"], act["recompute"])]
    terms.sort(key=lambda kv: -kv[1])
    return {
        "device_bytes": device,
        "peak_bytes": peak,
        "rank": rank,
        "fits": peak <= device,
        "warn": peak > WARN_FRACTION * device,
        "largest_terms": [[label, value] for label, value in terms[:4]],
        "alternatives": [],
    }


def _activation_alternatives(
    cfg: JobConfig, spec: ModelSpec, model: torch.nn.Module, tp: int, base: float, device: float
) -> list[dict[str, Any]]:
    """Each change of activation memory alone that the planner can evaluate on this build, with its planned peak
    (`base`: the largest rank's resident + transient bytes): full AC, op-level selective AC, the largest smaller
    micro-batch (with the accumulation steps that keep the tokens per step) that fits, or the smallest."""
    t, ac = cfg.training, cfg.activation_checkpoint
    out = []

    def add(change: str, **overrides) -> bool:
        peak = base + activation_estimate(spec, model, cfg, tp, **overrides).total
        out.append({"change": change, "peak_bytes": peak, "fits": peak <= device})
        return peak <= device

    if ac.mode != "full":
        add("--activation_checkpoint.mode full", ac_mode="full")
    if ac.mode == "none" or (ac.mode == "selective" and ac.selective_ac_option != "op"):  # op keeps more than full
        add(
            "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
            ac_mode="selective",
            ac_option="op",
        )
    sequences = t.local_batch_size * t.gradient_accumulation_steps
    smaller = [b for b in range(t.local_batch_size - 1, 0, -1) if sequences % b == 0]
    for b in smaller:
        change = f"--training.local_batch_size {b} --training.gradient_accumulation_steps {sequences // b}"
        if add(change, batch=b) or b == smaller[-1]:
            break
        out.pop()  # only the largest micro-batch that fits (or the smallest, which does not) is listed
    return out


# ------------------------------------------------------------------------------------------- FSDP2 shards
def chunk_sizes(size: np.ndarray | int, parts: int, index: np.ndarray) -> np.ndarray:
    """The length of chunk `index` (per rank) of `size` entries cut in `parts`, as torch.chunk cuts them (and DTensor's
    Shard, and FSDP2's dim-0 shards): ceil(size / parts) each, the last shorter, any after it empty."""
    size = np.asarray(size, dtype=np.int64)
    per = -(-size // parts)
    return np.clip(np.minimum(size, (index + 1) * per) - index * per, 0, None)


def local_numel(
    shape: Sequence[int], axes: Sequence[str], axis_sizes: Sequence[int], placements: Sequence, coords: dict
) -> np.ndarray:
    """Per rank: the elements of its local tensor of a param of global `shape` placed by `placements` on a mesh with
    named `axes` of `axis_sizes`. The TP / EP axes' shards first (a Shard(d) cuts dim d), then FSDP2's (dim 0 of
    what they leave, FSDP_SHARD_AXES); a Replicate axis keeps it whole."""
    world = len(next(iter(coords.values())))
    local = [np.full(world, int(d), dtype=np.int64) for d in shape]
    ordered = sorted(range(len(axes)), key=lambda i: axes[i] in FSDP_SHARD_AXES)  # stable: TP/EP, then FSDP2
    for i in ordered:
        pl, name = placements[i], axes[i]
        if pl.is_replicate():
            continue
        if not (pl.is_shard() or name in FSDP_SHARD_AXES):  # FSDP2's may be a strided shard of the TP one
            raise ValueError(f"mesh axis {name!r}: the planner models Shard and Replicate placements, got {pl}")
        d = pl.dim
        local[d] = chunk_sizes(local[d], axis_sizes[i], coords[name])
    return np.prod(np.stack(local), axis=0).astype(float) if local else np.ones(world)


def fsdp_local_numel(
    model: torch.nn.Module, own: set, coords: dict[str, np.ndarray], block_prefixes: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(numel of every rank's FSDP2-managed local tensors, of those outside the blocks), per global rank: each
    param's `local_numel` at every rank's coordinates, computed once per (shape, mesh, placements)."""
    world = len(next(iter(coords.values())))
    total, root = np.zeros(world), np.zeros(world)
    cache: dict[tuple, np.ndarray] = {}
    for fqn, p in model.named_parameters():
        if p in own:
            continue
        if isinstance(p, DTensor):
            names = tuple(p.device_mesh.mesh_dim_names)
            key = (tuple(p.shape), names, tuple(p.device_mesh.shape), tuple(p.placements))
        else:
            key = (tuple(p.shape), (), (), ())
        if key not in cache:
            shape, names, mesh_shape, placements = key
            unknown = set(names) - set(coords)
            if unknown:
                raise ValueError(f"{fqn}: the planner has no rank coordinates for mesh dims {sorted(unknown)}")
            cache[key] = local_numel(shape, names, mesh_shape, placements, coords)
        total += cache[key]
        if not fqn.startswith(block_prefixes):
            root += cache[key]
    return total, root


def packed_peak(sizes: Sequence[float], z3: bool) -> float:
    """Bytes of DMuon's packed buffers alive at once (docs/dmuon.md lifecycle, the code's order), `sizes` the
    groups' packed-buffer bytes in forward order.

    Forward: Z3 holds the current group and the prefetched next one; Z2 ends forward with every group's. Backward
    (reverse order), when group g's last grad lands: its buffer and the prefetched g-1 (Z2: every group not yet
    reduced), the autograd grads of g and the packed grad buffer they are copied into, and the two older packed
    grad buffers the reduce pipeline still holds (one stage-1 reduce and one stage-2 in flight)."""
    n = len(sizes)

    def s(i: int) -> float:
        return sizes[i] if 0 <= i < n else 0.0

    forward = max((s(g) + s(g + 1) for g in range(n)), default=0.0) if z3 else sum(sizes)
    backward = 0.0
    for g in reversed(range(n)):
        params = s(g) + s(g - 1) if z3 else sum(sizes[: g + 1])
        backward = max(backward, params + 2 * s(g) + s(g + 1) + s(g + 2))
    return max(forward, backward)


def _whole_on_tp_owner(m: dmuon.costs.Matrix, cfg: JobConfig, settings: CommSettings) -> bool:
    """Whether a dedicated matrix's momentum (and its gathered grad) lives whole on its TP owner: a dense TP matrix on
    the "gather" path with optimizer.dmuon.tp_gather "backward" (docs/dmuon.md, "The TP gather")."""
    return (
        cfg.optimizer.dmuon.tp_gather == "backward"
        and not m.expert
        and m.shard_dim is not None
        and settings.tp_decision(m).path == "gather"
    )


# ---------------------------------------------------------------------------------------------- the plan
def plan_memory(
    model: torch.nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: JobConfig,
    device_bytes: float | None = None,
    rank: int | None = None,
    pp_rank: int = 0,
) -> tuple[dict[str, Any], dict[str, Any], Placement]:
    """Every rank's memory for the parallelized (meta) `model` and whether rank `rank`'s (default: the largest) fits
    `device_bytes` (default `job.dry_run_device_memory_gib`): (memory terms by rank, capacity, the placement the
    other sections reuse). The dry run calls it on its fake world; a real run on CUDA on its own build, before it
    allocates anything (`check_device_memory`). Under a pipeline `model` is the part of pp rank `pp_rank` (every
    stage's ranks are laid out alike), and its activations are those of the microbatches the schedule keeps in
    flight there (`pipeline_activations`)."""
    R, N, T, W = dims.dp_replicate, dims.dp_shard, dims.tp, dims.world_size
    G_e = dims.expert_shard_size
    coords = dims.coordinates()
    t = cfg.training
    z3 = cfg.optimizer.dmuon.reshard_after_forward
    e_param = to_dtype(t.mixed_precision_param).itemsize
    e_reduce = to_dtype(t.mixed_precision_reduce).itemsize

    matrices = dmuon.dedicated_matrices(model, cfg.optimizer.muon.to_options())
    own = {dp.param for dp in dmuon.get_dedicated_params(model)} if matrices else set()
    master_bytes = dmuon.costs.MASTER_ITEMSIZE  # fp32 masters, momentum and reduced grads
    fsdp_elem = next((p.dtype.itemsize for p in model.parameters() if p not in own), 4)

    blocks = spec.blocks(model)
    units = {id(b) for b in fsdp_blocks(blocks, own)}  # the other blocks' params are the root unit's
    block_prefixes = tuple(f"{fqn}." for fqn, b in blocks if id(b) in units)
    if dims.ep_enabled:  # expert stacks the optimizer leaves to FSDP2 are units of their own (parallelize.py)
        names = {id(m): fqn for fqn, m in model.named_modules()}
        block_prefixes += tuple(
            f"{names[id(m)]}." for m in expert_modules(model) if not all(p in own for p in m.parameters())
        )
    fsdp_numel, fsdp_root_numel = fsdp_local_numel(model, own, coords, block_prefixes)
    # P_col(s): dedicated (TP-local, EP-local) elements owned in shard column s; owner: what the global owner
    # (s, r) updates. The dense matrices' columns are shard coordinates, the expert stacks' expert-shard ones.
    col_numel, owner_numel = np.zeros(N), np.zeros((R, N))
    e_col_numel, e_owner_numel = np.zeros(G_e), np.zeros((R, G_e))
    # A TP matrix gathered from the backward (optimizer.dmuon.tp_gather "backward", its "gather" path) keeps its
    # momentum whole on its TP owner, which also holds its gathered fp32 grad from the backward to the step:
    # `whole` counts those full matrices at (replicate, shard, TP owner), `whole_local` their shards on the owners.
    whole, whole_local = np.zeros((R, N, T)), np.zeros((R, N))
    settings = CommSettings.from_config(cfg)
    for m in matrices:
        col, owner = (e_col_numel, e_owner_numel) if m.expert else (col_numel, owner_numel)
        col[m.owner_shard] += m.numel
        owner[m.owner_replicate, m.owner_shard] += m.numel
        if _whole_on_tp_owner(m, cfg, settings):
            whole[m.owner_replicate, m.owner_shard, m.tp_owner] += math.prod(m.full_shape)
            whole_local[m.owner_replicate, m.owner_shard] += m.numel
    r_of, s_of, es_of, t_of = coords["replicate"], coords["shard"], coords["expert_shard"], coords["tp"]
    masters = (col_numel[s_of] + e_col_numel[es_of]) * master_bytes
    reduced = (owner_numel[r_of, s_of] + e_owner_numel[r_of, es_of]) * master_bytes  # the owners' _reduced_grad
    gathered = whole[r_of, s_of, t_of] * master_bytes
    momentum = reduced - whole_local[r_of, s_of] * master_bytes + gathered
    fsdp = fsdp_numel * fsdp_elem
    adamw = 2 * fsdp
    grads = fsdp + reduced + gathered  # FSDP2's sharded grads + the owners' fp32 reduced grads + the TP gathered
    resident = fsdp + masters + momentum + adamw + grads
    groups: dict[int, list[dmuon.costs.Matrix]] = {}
    for m in matrices:
        groups.setdefault(m.group, []).append(m)
    group_bytes = [sum(m.numel for m in groups[i]) * groups[i][0].param_itemsize for i in sorted(groups)]
    transient = packed_peak(group_bytes, z3)
    # FSDP2's root unit (embeddings, output, and under DMuon every block's norms) is gathered whole per TP rank from
    # forward to the end of backward ("default": not resharded after forward; "always": gathered again for
    # backward), and its unsharded grads, cast to the reduce dtype, wait for their reduce-scatter at the end.
    P = dims.pp  # every stage's ranks alike (this part placed on each)
    root = fsdp_root_numel.reshape(P, R, N, T).sum(axis=2, keepdims=True).repeat(N, axis=2).reshape(-1)
    root_unsharded = root * (e_param + e_reduce)
    base = resident + transient + root_unsharded  # per rank; the activations are the same on every rank
    estimate = pipeline_activations(spec, model, cfg, dims, pp_rank)
    activations = estimate.total if estimate is not None else 0.0
    peak = base + activations
    memory = {
        "fsdp_param_shards": summary(fsdp),
        "dmuon_fp32_masters": summary(masters),
        "muon_momentum": summary(momentum),
        "adamw_moments": summary(adamw),
        "gradients": summary(grads),
        "resident_total": summary(resident),
        "dmuon_packed_transient_peak": summary(np.full(W, transient)),
        "fsdp_root_unsharded": summary(root_unsharded),
        "activations_estimate": None if estimate is None else summary(np.full(W, activations)),
        "activation_terms": None if estimate is None else _activation_terms(estimate),
        "peak_estimate": summary(peak),
    }
    device = cfg.job.dry_run_device_memory_gib * GIB if device_bytes is None else device_bytes
    rank = int(np.argmax(peak)) if rank is None else rank  # the dry run: the largest rank; a real run: its own
    capacity = _capacity(memory, rank, device)
    if not capacity["fits"] and estimate is not None:
        capacity["alternatives"] = _activation_alternatives(cfg, spec, model, T, float(base[rank]), device)
    placement = Placement(
        dims=dims,
        coords=coords,
        matrices=matrices,
        z3=z3,
        param_itemsize=e_param,
        reduce_itemsize=e_reduce,
        fsdp_numel=fsdp_numel,
        fsdp_root_numel=fsdp_root_numel,
    )
    return memory, capacity, placement
