"""Dry-run planner: what a run costs on a cluster you do not have, from this CPU.

    python train.py --config train_configs/llama3_70b.toml --job.dry_run --job.dry_run_world_size 256 \\
        --parallelism.data_parallel_replicate_degree 4 --parallelism.tensor_parallel_degree 1

It builds the real model and the real placement with the trainer's own code (build_meta_model, then
`parallelize`: TP -> AC -> compile -> DMuon's dedicate_params -> FSDP2) on meta tensors, as rank 0 of torch's
fake process group of `job.dry_run_world_size` ranks (collectives are no-ops; nothing is allocated). Every other
rank's figures follow from that one build, exactly: DMuon's LPT plan is global and the same on every rank (owner
coordinates, TP owners), and a rank's FSDP2 / TP shard shapes are torch's own shard arithmetic evaluated at its
mesh coordinate. Rank g sits at (replicate, shard, tp) = row-major coordinates of g in the (R, N, T) mesh, on node
g // job.dry_run_gpus_per_node (as torchrun numbers ranks); `--job.dry_run_nodes M` plans M nodes of that many GPUs
and the plan starts with the node layout the run's start-up log will show (titan_dmuon/parallel/layout.py).

Expert parallelism (`parallelism.expert_parallel_degree` = E, MoE models): the mesh is (R, N / E, E, T) =
(replicate, efsdp, ep, tp), the dense shard coordinate the flattened (efsdp, ep) one, as without EP (`Mesh`). Each
rank holds its EP shard of every expert stack (P_E / E elements); DMuon owns the stacks over the expert axes (its
`expert_mesh`: the G_e = N / E x T ranks of an expert shard group, coordinate efsdp x T + tp, replicate as the dense
matrices, "tp" the EP index), so an owner's fp32 masters, momentum and reduced grad of a stack are its EP shard's, on
the EP ranks of its expert column; its ledger kinds (broadcast, reduce, replicate_*) are over G_e, not N, and land
in the same kinds; its NS runs on each of its owner's E EP ranks (their own experts, no TP gather or scatter). The MoE
layers' token all-to-all is printed apart (`expert_parallel.all_to_all_bytes`, uniform routing: it is the model's,
the same under every optimizer); the naive FSDP2 + Muon and FSDP2 + AdamW figures shard the stacks over the G_e
ranks of the expert FSDP mesh, as `apply_fsdp` does.

Printed (and written to `job.dry_run_json`, with every rank's value): per-rank resident bytes (FSDP2 shards,
DMuon fp32 masters, Muon momentum, AdamW moments, gradients), the DMuon packed-buffer transient peak and an
activation estimate; the LPT plan (Newton-Schulz FLOPs per rank against a certified lower bound, owners per
layer) and the owners' NS time at a given TFLOP/s; DMuon's bytes per step by ledger kind (the figures
`dmuon.comm_stats` reports on a real run, next to the docs/dmuon.md formulas) and, on the same mesh, naive
FSDP2 + Muon and FSDP2 + AdamW; with MoE layers, their all-to-all bytes per rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from titan_dmuon import dmuon
from titan_dmuon.components.model import ModelSpec, build_meta_model, check_flavor, get_model_spec, model_vocab_size
from titan_dmuon.components.optimizer import build_optimizer_component
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.dmuon.muon import EXPERT_BLOCKS
from titan_dmuon.dmuon.newton_schulz import gram_restarts, resolve_coefficients
from titan_dmuon.dmuon.partition import PartitionItem, item_cost
from titan_dmuon.dmuon.tp import heads_are_local
from titan_dmuon.parallel import ParallelDims, fsdp_blocks, parallelize
from titan_dmuon.parallel.expert_parallel import all_to_all_bytes, expert_modules, moe_modules
from titan_dmuon.parallel.layout import describe_layout
from titan_dmuon.parallel.parallelize import ac_plan

logger = logging.getLogger(__name__)

GIB, MIB = 2.0**30, 2.0**20


@dataclass(frozen=True)
class Mesh:
    """The run's (replicate, shard, tp) degrees, its expert-parallel degree E (dividing the shard degree N), and
    every global rank's coordinates (row-major, as ParallelDims.build_mesh).

    Without EP the mesh is (R, N, T); with EP it is (R, N / E, E, T) = (replicate, efsdp, ep, tp), and "shard" is
    the flattened (efsdp, ep): the same shard coordinate as without EP. The expert stacks are owned over the
    expert axes (DMuon's `expert_mesh`): their shard coordinate is "expert_shard" = efsdp x T + tp (the flattened
    (efsdp, tp) under TP, efsdp alone without), G_e = N / E x T ranks, and their "tp" coordinate is the EP index."""

    R: int
    N: int
    T: int
    E: int = 1

    def __post_init__(self) -> None:
        if self.E < 1 or self.N % self.E:
            raise ValueError(f"the expert-parallel degree {self.E} must divide the shard degree {self.N}")

    @property
    def world(self) -> int:
        return self.R * self.N * self.T

    @property
    def efsdp(self) -> int:
        return self.N // self.E

    @property
    def expert_shard_size(self) -> int:
        """G_e: the ranks that hold the same experts and route different tokens (the expert shard group)."""
        return self.efsdp * self.T

    def coords(self) -> dict[str, np.ndarray]:
        """Every global rank's coordinate on each named mesh dim (flattened ones included), by name."""
        g = np.arange(self.world)
        efsdp, ep, tp = (g // (self.E * self.T)) % self.efsdp, (g // self.T) % self.E, g % self.T
        expert_shard = efsdp * self.T + tp
        return {
            "replicate": g // (self.N * self.T),
            "shard": (g // self.T) % self.N,
            "tp": tp,
            "efsdp": efsdp,
            "ep": ep,
            "expert_shard": expert_shard,
        }

    def rank(self, replicate: int, shard: int, tp: int) -> int:
        return (replicate * self.N + shard) * self.T + tp

    def expert_rank(self, replicate: int, expert_shard: int, ep: int) -> int:
        """The global rank at an expert-axes coordinate (expert shard index, replicate, EP index)."""
        efsdp, tp = divmod(expert_shard, self.T)
        return ((replicate * self.efsdp + efsdp) * self.E + ep) * self.T + tp


# ------------------------------------------------------------------------------------------- capacity
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


def _activation_estimate(spec: ModelSpec, model: torch.nn.Module, cfg: JobConfig, tp: int, **overrides):
    """The model family's activation estimate for this config (`overrides` replace its arguments), or None."""
    if spec.activation_estimate is None:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint
    kwargs = dict(
        batch=t.local_batch_size,
        seq_len=t.seq_len,
        dtype_bytes=dmuon.to_dtype(t.mixed_precision_param).itemsize,
        tp=tp,
        ac_mode=ac.mode,
        ac_option=ac.selective_ac_option,
        loss_parallel=not cfg.parallelism.disable_loss_parallel,
    )
    return spec.activation_estimate(model, **{**kwargs, **overrides})


def _ac_label(cfg: JobConfig) -> str:
    ac = cfg.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode
    return "selective (op)" if ac.selective_ac_option == "op" else f"selective (every {ac.selective_ac_option})"


def _activation_terms(estimate) -> dict[str, float]:
    return {k: float(getattr(estimate, k)) for k in ACTIVATION_TERMS} | {"total": float(estimate.total)}


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
        peak = base + _activation_estimate(spec, model, cfg, tp, **overrides).total
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


def tp_alternatives(cfg: JobConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Larger TP degrees (x2, x4, ... within a node, dividing the heads), each planned anew on the same world (the
    shard degree shrinks to match), up to the first that fits. Call it with no process group (it makes its own)."""
    mesh, device = result["config"]["mesh"], cfg.job.dry_run_device_memory_gib * GIB
    world, out = result["config"]["world_size"], []
    tp = mesh["tp"] * 2
    while tp <= cfg.job.dry_run_gpus_per_node and world % (tp * mesh["replicate"]) == 0:
        par = dataclasses.replace(cfg.parallelism, tensor_parallel_degree=tp, data_parallel_shard_degree=-1)
        change = f"--parallelism.tensor_parallel_degree {tp}"
        try:
            peak = plan(dataclasses.replace(cfg, parallelism=par), world)["capacity"]["peak_bytes"]
        except Exception as e:  # the degree does not fit the model (heads, sequence): no larger one will
            logger.info("TP %d cannot be planned: %s", tp, e)
            break
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        out.append({"change": change, "peak_bytes": peak, "fits": peak <= device})
        if peak <= device:
            break
        tp *= 2
    return out


def check_device_memory(
    model: torch.nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: JobConfig,
    rank: int,
    free: float,
    total: float,
    worst_of_ranks: Callable[[float], float] = lambda ratio: ratio,
) -> None:
    """A real run's check, before it allocates the model: this rank's planned peak (`plan_memory` on its own meta
    build) against the device's `free` bytes (of `total`). `worst_of_ranks` takes this rank's peak / free and
    returns the largest over the job's ranks (an all-reduce), so that every rank decides alike: above 90% a
    warning; above 100% a ConfigError on every rank (the one that does not fit names its largest terms and the
    changes that would fit), or only a warning with `job.check_device_memory = false`."""
    memory, capacity, _ = plan_memory(model, spec, dims, cfg, device_bytes=free, rank=rank)
    peak = capacity["peak_bytes"]
    worst = worst_of_ranks(peak / free)
    mine = f"{peak / GIB:.1f} GiB planned on rank {rank}, {free / GIB:.1f} GiB free on its GPU"
    mine += f" ({total / GIB:.1f} GiB in all)"
    if worst <= WARN_FRACTION:
        logger.info("Memory plan: %s", mine)
        return
    if worst <= 1.0 or not cfg.job.check_device_memory:
        logger.warning(
            "Memory plan: the largest rank's plan is %.0f%% of its free GPU memory (this rank: %s): %s",
            100 * worst,
            mine,
            "it may not fit" if worst > 1.0 else "fragmentation and the framework's buffers may not fit in the rest",
        )
        return
    if peak <= free:
        raise ConfigError(
            f"another rank's memory plan does not fit its GPU ({100 * worst:.0f}% of its free memory; its error names "
            f"the changes that would fit); this rank: {mine}"
        )
    raise ConfigError(
        f"the memory plan does not fit: {mine}.\n"
        + format_capacity({"capacity": capacity})
        + "\n(`--job.dry_run --job.dry_run_world_size N` plans this from any machine, larger TP degrees included; "
        "`--job.check_device_memory false` makes this a warning)"
    )


def format_capacity(p: dict[str, Any]) -> str:
    """The plan's verdict against the device: fits, fits but close (a warning), or does not fit, with its largest
    terms and the changes that would fit."""
    cap = p["capacity"]
    device, peak = cap["device_bytes"], cap["peak_bytes"]
    head = f"{peak / GIB:.1f} GiB planned on rank {cap['rank']} of a {device / GIB:g} GiB device"
    if cap["fits"] and not cap["warn"]:
        return f"Fits: {head} ({100 * peak / device:.0f}%)."
    if cap["fits"]:
        return (
            f"WARNING: fits, but close: {head} ({100 * peak / device:.0f}%, above {100 * WARN_FRACTION:.0f}%): "
            "fragmentation and the framework's own buffers may not fit in the rest."
        )
    lines = [f"Does not fit: {head}. The largest terms:"]
    lines += [f"  {label:<48} {value / GIB:10.1f} GiB" for label, value in cap["largest_terms"]]
    if cap["alternatives"]:
        lines.append("Each of these changes alone, planned (--job.dry_run_device_memory_gib sets the device):")
        lines += [
            f"  {a['change']:<88} {a['peak_bytes'] / GIB:8.1f} GiB  {'fits' if a['fits'] else 'does not fit'}"
            for a in cap["alternatives"]
        ]
    return "\n".join(lines)


def _head_blocks(model: torch.nn.Module, dps: list, options: dmuon.MuonOptions) -> dict[str, tuple[int, int] | None]:
    """fqn -> the blocks its update is split into (per-head Muon; an expert stack's experts, always), None for a
    whole-matrix update (dmuon.Muon's `_active_head_blocks`)."""
    state = dmuon.state.find_state(model)
    recorded = state.head_blocks if state is not None else {}
    return {
        dp.fqn: EXPERT_BLOCKS if len(dp.full_shape) == 3 else options.active_blocks(recorded.get(dp.fqn)) for dp in dps
    }


# ------------------------------------------------------------------------------------------------- build
def _vocab_size(cfg: JobConfig, spec: ModelSpec) -> tuple[int | None, str]:
    """The tokenizer's vocabulary when it can be loaded here, else the flavor's own (a dry run needs no data)."""
    from titan_dmuon.data import DataError, build_tokenizer

    try:
        tokenizer = build_tokenizer(cfg.model.tokenizer)
        vocab = model_vocab_size(cfg, tokenizer.vocab_size)
        padded = f", padded to {vocab}" if vocab != tokenizer.vocab_size else ""
        return vocab, f"tokenizer {cfg.model.tokenizer}{padded}"
    except DataError as e:
        if cfg.model.vocab_size:
            return cfg.model.vocab_size, "model.vocab_size"
        own = getattr(spec.flavors[cfg.model.flavor], "vocab_size", -1)
        if own and own > 0:
            return None, f"the flavor's {own} (tokenizer {cfg.model.tokenizer!r} not loadable here)"
        raise ConfigError(f"model.tokenizer: {e} (the dry run needs the vocabulary size)") from None


def build_on_fake_world(cfg: JobConfig, world_size: int) -> tuple[torch.nn.Module, ModelSpec, ParallelDims, dict]:
    """Rank 0 of a fake world: the meta model with the real TP / DMuon / FSDP2 placement (the trainer's code)."""
    if cfg.optimizer.name != "dmuon":
        raise ConfigError(
            f"job.dry_run plans DMuon runs (optimizer.name = 'dmuon'), got {cfg.optimizer.name!r}: its tables put "
            "muon_naive and adamw next to it on the same mesh"
        )
    try:
        spec = get_model_spec(cfg.model.name)
        check_flavor(spec, cfg.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    component = build_optimizer_component(cfg, spec)
    dims = ParallelDims.from_config(cfg, world_size, cfg.job.dry_run_gpus_per_node)
    vocab, vocab_source = _vocab_size(cfg, spec)
    # torch.compile wraps each block's forward and changes no placement or byte: skip its set-up here.
    cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, enable=False))
    if dist.is_initialized():
        raise RuntimeError("the dry-run planner makes its own (fake) process group: call it in a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    model = build_meta_model(spec, cfg, vocab)
    nparams, flops_per_token = spec.nparams_and_flops(model, cfg.training.seq_len)
    model = parallelize(model, dims, mesh, cfg, spec, component)
    info = {"params": nparams, "flops_per_token": flops_per_token, "vocab": vocab_source}
    return model, spec, dims, info


# ------------------------------------------------------------------------------------------- per rank
def _fsdp_local_numel(
    model: torch.nn.Module, own: set, mesh: Mesh, block_prefixes: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(numel of every rank's FSDP2-managed local tensors, of those outside the blocks), per global rank.

    Each param's local shape at a rank is torch's `_compute_local_shape_and_global_offset` at that rank's
    coordinate in the param's mesh (FSDP2's Shard(0), `_StridedShard` over TP, TP shards), cached per class."""
    coords = mesh.coords()
    total, root = np.zeros(mesh.world), np.zeros(mesh.world)
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
            if not names:
                cache[key] = np.full(mesh.world, float(p.numel()))
            else:  # only the coordinates of sharded mesh dims matter: a Replicate dim's is set to 0
                at = np.stack(
                    [coords[n] * (not pl.is_replicate()) for n, pl in zip(names, placements, strict=True)], axis=1
                )
                seen: dict[tuple, float] = {}
                values = np.empty(mesh.world)
                for g in range(mesh.world):
                    c = tuple(int(v) for v in at[g])
                    if c not in seen:
                        local, _ = _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), placements)
                        seen[c] = float(np.prod(local))
                    values[g] = seen[c]
                cache[key] = values
        total += cache[key]
        if not fqn.startswith(block_prefixes):
            root += cache[key]
    return total, root


def _packed_peak(sizes: Sequence[float], z3: bool) -> float:
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


def _summary(values: np.ndarray) -> dict[str, Any]:
    v = [float(x) for x in values]
    return {"min": min(v), "median": float(statistics.median(v)), "max": max(v), "per_rank": v}


def plan_memory(
    model: torch.nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: JobConfig,
    device_bytes: float | None = None,
    rank: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every rank's memory for the parallelized (meta) `model` and whether rank `rank`'s (default: the largest) fits
    `device_bytes` (default `job.dry_run_device_memory_gib`): (memory terms by rank, capacity, what the other
    sections reuse). The dry run calls it on its fake world; a real run on
    CUDA on its own build, before it allocates anything (`check_device_memory`)."""
    mesh = Mesh(dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep)
    R, N, T, W = mesh.R, mesh.N, mesh.T, mesh.world
    coords = mesh.coords()
    G_e = mesh.expert_shard_size
    t = cfg.training
    z3 = cfg.optimizer.dmuon.reshard_after_forward
    param_dtype = dmuon.to_dtype(t.mixed_precision_param)
    reduce_dtype = dmuon.to_dtype(t.mixed_precision_reduce)
    e_param = param_dtype.itemsize
    e_reduce = reduce_dtype.itemsize

    state = dmuon.state.find_state(model)
    dps = dmuon.get_dedicated_params(model) if state is not None else []
    expert_axes = state.expert_axes if state is not None else None
    experts = {dp.fqn for dp in dps if expert_axes is not None and dp.axes is expert_axes}  # owned over EP's axes
    own = set(dp.param for dp in dps)
    master_bytes = 4.0  # fp32 masters, momentum and reduced grads
    fsdp_elem = next((p.dtype.itemsize for p in model.parameters() if p not in own), 4)

    # ---- memory per rank ----------------------------------------------------------------------------------
    blocks = spec.blocks(model)
    units = {id(b) for b in fsdp_blocks(blocks, own)}  # the other blocks' params are the root unit's
    block_prefixes = tuple(f"{fqn}." for fqn, b in blocks if id(b) in units)
    if dims.ep_enabled:  # expert stacks the optimizer leaves to FSDP2 are units of their own (parallelize.py)
        names = {id(m): fqn for fqn, m in model.named_modules()}
        block_prefixes += tuple(
            f"{names[id(m)]}." for m in expert_modules(model) if not all(p in own for p in m.parameters())
        )
    fsdp_numel, fsdp_root_numel = _fsdp_local_numel(model, own, mesh, block_prefixes)
    # P_col(s): dedicated (TP-local, EP-local) elements owned in shard column s; owner: what the global owner
    # (s, r) updates. The dense matrices' columns are shard coordinates, the expert stacks' expert-shard ones.
    col_numel, owner_numel = np.zeros(N), np.zeros((R, N))
    e_col_numel, e_owner_numel = np.zeros(G_e), np.zeros((R, G_e))
    for dp in dps:
        col, owner = (e_col_numel, e_owner_numel) if dp.fqn in experts else (col_numel, owner_numel)
        col[dp.owner_shard] += dp.numel
        owner[dp.owner_replicate, dp.owner_shard] += dp.numel
    r_of, s_of, es_of = coords["replicate"], coords["shard"], coords["expert_shard"]
    masters = (col_numel[s_of] + e_col_numel[es_of]) * master_bytes
    momentum = (owner_numel[r_of, s_of] + e_owner_numel[r_of, es_of]) * master_bytes
    fsdp = fsdp_numel * fsdp_elem
    adamw = 2 * fsdp
    grads = fsdp + momentum  # FSDP2's sharded grads + the global owners' fp32 _reduced_grad
    resident = fsdp + masters + momentum + adamw + grads
    groups: dict[int, list] = {}
    for dp in dps:
        groups.setdefault(dp.group.index, []).append(dp)
    group_bytes = [sum(d.numel for d in groups[i]) * groups[i][0].group.dtype.itemsize for i in sorted(groups)]
    transient = _packed_peak(group_bytes, z3)
    # FSDP2's root unit (embeddings, output, and under DMuon every block's norms) is gathered whole per TP rank from
    # forward to the end of backward ("default": not resharded after forward; "always": gathered again for
    # backward), and its unsharded grads, cast to the reduce dtype, wait for their reduce-scatter at the end.
    root = fsdp_root_numel.reshape(R, N, T).sum(axis=1, keepdims=True).repeat(N, axis=1).reshape(-1)
    root_unsharded = root * (e_param + e_reduce)
    base = resident + transient + root_unsharded  # per rank; the activations are the same on every rank
    estimate = _activation_estimate(spec, model, cfg, T)
    activations = estimate.total if estimate is not None else 0.0
    peak = base + activations
    memory = {
        "fsdp_param_shards": _summary(fsdp),
        "dmuon_fp32_masters": _summary(masters),
        "muon_momentum": _summary(momentum),
        "adamw_moments": _summary(adamw),
        "gradients": _summary(grads),
        "resident_total": _summary(resident),
        "dmuon_packed_transient_peak": _summary(np.full(W, transient)),
        "fsdp_root_unsharded": _summary(root_unsharded),
        "activations_estimate": None if estimate is None else _summary(np.full(W, activations)),
        "activation_terms": None if estimate is None else _activation_terms(estimate),
        "peak_estimate": _summary(peak),
    }
    device = cfg.job.dry_run_device_memory_gib * GIB if device_bytes is None else device_bytes
    rank = int(np.argmax(peak)) if rank is None else rank  # the dry run: the largest rank; a real run: its own
    capacity = _capacity(memory, rank, device)
    if not capacity["fits"] and estimate is not None:
        capacity["alternatives"] = _activation_alternatives(cfg, spec, model, T, float(base[rank]), device)
    ctx = dict(mesh=mesh, coords=coords, dps=dps, z3=z3, fsdp_numel=fsdp_numel, fsdp_root_numel=fsdp_root_numel)
    return memory, capacity, ctx | dict(e_param=e_param, e_reduce=e_reduce, experts=experts)


def plan(cfg: JobConfig, world_size: int | None = None) -> dict[str, Any]:
    """Every figure of the dry run as a JSON-able dict (`format_plan` prints it)."""
    world_size = world_size or cfg.job.dry_run_world_size or cfg.job.dry_run_nodes * cfg.job.dry_run_gpus_per_node
    started = time.perf_counter()
    model, spec, dims, info = build_on_fake_world(cfg, world_size)
    memory, capacity, ctx = plan_memory(model, spec, dims, cfg)
    mesh, coords, dps, z3, experts = ctx["mesh"], ctx["coords"], ctx["dps"], ctx["z3"], ctx["experts"]
    R, N, T, W, E, G_e = mesh.R, mesh.N, mesh.T, mesh.world, mesh.E, mesh.expert_shard_size
    t, m = cfg.training, cfg.optimizer.muon
    fsdp_numel, fsdp_root_numel, e_param, e_reduce = (
        ctx[k] for k in ("fsdp_numel", "fsdp_root_numel", "e_param", "e_reduce")
    )

    # ---- LPT plan -----------------------------------------------------------------------------------------
    ns_steps = m.ns_steps
    blocks_of = _head_blocks(model, dps, m.to_options())
    cost = {  # half the matmul FLOPs; per-head Muon: blocks x a block's; an expert stack: experts x an expert's
        dp.fqn: item_cost(PartitionItem(dp.fqn, tuple(dp.full_shape), "", head_blocks=blocks_of[dp.fqn]), ns_steps)
        for dp in dps
    }
    heads_local = {dp.fqn for dp in dps if blocks_of[dp.fqn] and heads_are_local(dp, blocks_of[dp.fqn])}
    ns_flops = np.zeros(W)
    jobs: list[float] = []
    for dp in dps:  # a TP-sharded matrix runs on its TP owner; an unsharded one on each TP rank's DP owner
        if dp.fqn in experts:  # an expert stack under EP: each EP rank of its owner runs NS on its E/EP experts
            for ep in range(E):
                ns_flops[mesh.expert_rank(dp.owner_replicate, dp.owner_shard, ep)] += 2 * cost[dp.fqn] / E
                jobs.append(2 * cost[dp.fqn] / E)
            continue
        if dp.fqn in heads_local:  # per-head Muon, whole heads in each TP shard: each TP rank its own heads
            for tp in range(T):
                ns_flops[mesh.rank(dp.owner_replicate, dp.owner_shard, tp)] += 2 * cost[dp.fqn] / T
                jobs.append(2 * cost[dp.fqn] / T)
            continue
        for tp in [dp.tp_owner] if dp.tp_group is not None else range(T):
            ns_flops[mesh.rank(dp.owner_replicate, dp.owner_shard, tp)] += 2 * cost[dp.fqn]
            jobs.append(2 * cost[dp.fqn])
    bound = dmuon.partition.makespan_lower_bound(jobs, W)
    # each LPT (the dense matrices over the R x N slots, the expert stacks over R x G_e) against its own bound
    slot_ratio = {}
    for kind, slots, items in (
        ("dense", R * N, [dp for dp in dps if dp.fqn not in experts]),
        ("experts", R * G_e, [dp for dp in dps if dp.fqn in experts]),
    ):
        slot_cost = np.zeros(slots)
        for dp in items:
            slot_cost[dp.owner_replicate * (slots // R) + dp.owner_shard] += cost[dp.fqn]
        slot_bound = dmuon.partition.makespan_lower_bound([cost[dp.fqn] for dp in items], slots)
        slot_ratio[kind] = float(slot_cost.max()) / slot_bound if slot_bound else 0.0
    block_names = sorted((fqn for fqn, _ in spec.blocks(model)), key=len, reverse=True)

    def layer_of(dp) -> str:  # the block a matrix is in (an expert stack's hook group is its experts module)
        return next((b for b in block_names if dp.fqn.startswith(f"{b}.")), dp.group.module_fqn)

    by_layer: dict[str, list] = {}
    for dp in dps:
        by_layer.setdefault(layer_of(dp), []).append(dp)
    owners_per_layer = [  # an expert slot is another rank than the dense slot of the same coordinates
        len({(d.fqn in experts, d.owner_shard, d.owner_replicate) for d in v}) for v in by_layer.values()
    ]
    first = next(iter(by_layer.values()), [])
    tflops = cfg.job.dry_run_tflops
    naive_flops = 2 * sum(cost.values())  # naive FSDP2 + Muon: every rank orthogonalizes every full matrix
    mean = float(ns_flops.mean())

    def tp_owner(d) -> int | None:  # the TP rank that runs a TP-sharded matrix's NS (an expert stack: every EP rank)
        return d.tp_owner if d.tp_group is not None and d.fqn not in experts else None

    lpt = {
        "matrices": len(dps),
        "expert_stacks": len(experts),
        "layers": len(by_layer),
        "slots": R * N,
        "expert_slots": R * G_e if experts else 0,
        "ns_steps": ns_steps,
        "ns_flops_per_rank": _summary(ns_flops),
        "ns_flops_mean": mean,
        "ns_flops_lower_bound": bound,
        "max_over_mean": float(ns_flops.max()) / mean if mean else 0.0,
        "max_over_lower_bound": float(ns_flops.max()) / bound if bound else 0.0,
        "slot_max_over_lower_bound": slot_ratio["dense"],
        "expert_slot_max_over_lower_bound": slot_ratio["experts"],
        "owners_per_layer": {
            "min": min(owners_per_layer, default=0),
            "median": float(statistics.median(owners_per_layer)) if owners_per_layer else 0.0,
            "max": max(owners_per_layer, default=0),
            "matrices_per_layer": max((len(v) for v in by_layer.values()), default=0),
        },
        "first_layer": {
            d.fqn: {
                "owner_shard": d.owner_shard,
                "owner_replicate": d.owner_replicate,
                "tp_owner": d.tp_owner,
                "expert": d.fqn in experts,
            }
            for d in first
        },
        "owners": {d.fqn: [d.owner_shard, d.owner_replicate, tp_owner(d)] for d in dps},
        "tflops": tflops,
        "ns_time_s_max": float(ns_flops.max()) / (tflops * 1e12),
        "ns_time_s_mean": mean / (tflops * 1e12),
        "naive_ns_flops_per_rank": naive_flops,
        "naive_ns_time_s": naive_flops / (tflops * 1e12),
    }

    # ---- bytes per step -----------------------------------------------------------------------------------
    comm = _bytes_per_step(
        cfg, dps, blocks_of, mesh, coords, z3, fsdp_numel, fsdp_root_numel, e_param, e_reduce, experts
    )
    comm["moe_all_to_all"] = _moe_all_to_all(model, spec, cfg, mesh, e_param)

    elapsed = time.perf_counter() - started
    return {
        "config": {
            "model": f"{cfg.model.name}/{cfg.model.flavor}",
            "params": info["params"],
            "vocab": info["vocab"],
            "world_size": W,
            "mesh": {"replicate": R, "shard": N, "tp": T},
            "expert_parallel": {"ep": E, "efsdp": mesh.efsdp, "expert_shard": G_e} if E > 1 else None,
            "local_batch_size": t.local_batch_size,
            "seq_len": t.seq_len,
            "activation_checkpoint": _ac_label(cfg),
            "loss_parallel": T > 1 and not cfg.parallelism.disable_loss_parallel,
            "param_dtype": t.mixed_precision_param,
            "reduce_dtype": t.mixed_precision_reduce,
            "dmuon_mode": "Z3" if z3 else "Z2",
            "fsdp_reshard_after_forward": cfg.parallelism.fsdp_reshard_after_forward,
        },
        "layout": describe_layout(dims, [f"node{g // cfg.job.dry_run_gpus_per_node}" for g in range(W)]),
        "memory_bytes": memory,
        "capacity": capacity,
        "lpt": lpt,
        "bytes_per_step": comm,
        "planner": {"seconds": elapsed, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
    }


def _moe_layers(model: torch.nn.Module, spec: ModelSpec) -> list[tuple[int, torch.nn.Module]]:
    """(block index, MoE module) of every MoE layer, in forward order (expert_parallel.moe_modules' protocol)."""
    return [(i, m) for i, (_, block) in enumerate(spec.blocks(model)) for m in moe_modules(block)]


def _moe_all_to_all(model, spec: ModelSpec, cfg: JobConfig, mesh: Mesh, e_param: int) -> dict[str, Any] | None:
    """The MoE layers' token all-to-all per rank and step (the same under every optimizer), uniform routing:
    `expert_parallel.all_to_all_bytes` (forward dispatch and combine, and their grads in backward), plus the
    forward's two again in each checkpointed block (activation checkpointing recomputes it), plus each
    dispatch's exchange of the int64 expert counts. A rank routes its own sequence chunk under TP (sequence
    parallelism): its tokens are micro-batch x seq_len / T per micro-batch. None for a model without MoE layers."""
    layers = _moe_layers(model, spec)
    if not layers:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint
    tokens = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps // mesh.T
    chosen, _ = ac_plan(ac.mode, ac.selective_ac_option, len(spec.blocks(model)))
    recomputed = sum(1 for i, _ in layers if i in set(chosen))
    shapes = {(int(m.top_k), int(m.num_experts), int(m.experts.w1.shape[-1])) for _, m in layers}
    if len(shapes) != 1:
        raise ConfigError(f"the planner models MoE layers of one shape (top-k, experts, dim), got {sorted(shapes)}")
    top_k, num_experts, dim = shapes.pop()
    forward_backward = all_to_all_bytes(tokens, top_k, dim, mesh.E, e_param, len(layers))
    recompute = all_to_all_bytes(tokens, top_k, dim, mesh.E, e_param, recomputed) / 2
    micro_batches = t.gradient_accumulation_steps
    counts = (len(layers) + recomputed) * micro_batches * num_experts * 8 * (mesh.E - 1) / mesh.E
    return {
        "ep": mesh.E,
        "moe_layers": len(layers),
        "recomputed_layers": recomputed,
        "tokens_per_rank": tokens,
        "top_k": top_k,
        "num_experts": num_experts,
        "dim": dim,
        "element_bytes": e_param,
        "bytes": forward_backward,
        "ac_recompute_bytes": recompute,
        "counts_bytes": counts,
        "total": forward_backward + recompute + counts,
    }


def _bytes_per_step(
    cfg, dps, blocks_of, mesh: Mesh, coords, z3, fsdp_numel, fsdp_root_numel, e_param, e_reduce, experts=frozenset()
) -> dict:
    """Per rank, what DMuon's ledger records in a steady-state step (docs/dmuon.md, "Bytes per step" and "Experts"),
    the formulas, and the other two optimizers on the same mesh (the Muon matrices; the other params apart).
    `blocks_of`: fqn -> per-head blocks (a TP shard holding whole heads needs no gather, scatter or Gram);
    `experts`: the FQNs of the expert stacks owned over the expert axes (EP): their shard group is the G_e ranks
    of an expert shard group and their column an expert-shard coordinate; their NS is local (no TP traffic)."""
    R, N, T, W, E, G_e = mesh.R, mesh.N, mesh.T, mesh.world, mesh.E, mesh.expert_shard_size
    s_of, r_of, es_of = coords["shard"], coords["replicate"], coords["expert_shard"]
    frac = lambda k: (k - 1) / k  # noqa: E731 - the per-rank share of a rooted collective over k ranks
    kinds = ("broadcast", "reduce", "replicate_reduce", "replicate_broadcast", "tp_gather", "tp_scatter", "tp_gram")
    elements = {k: np.zeros(W) for k in kinds}
    nbytes = {k: np.zeros(W) for k in kinds}
    dense = [dp for dp in dps if dp.fqn not in experts]
    stacks = [dp for dp in dps if dp.fqn in experts]
    p_m = float(sum(dp.numel for dp in dense))
    p_e = float(sum(dp.numel for dp in stacks))  # per EP rank: its E/EP experts of each stack
    p_col, m_col = np.zeros(N), np.zeros(N)
    pe_col, me_col = np.zeros(G_e), np.zeros(G_e)
    for dp in dps:
        pc, mc = (pe_col, me_col) if dp.fqn in experts else (p_col, m_col)
        pc[dp.owner_shard] += dp.numel
        mc[dp.owner_shard] += 1
    e_buf = dps[0].group.dtype.itemsize if dps else e_param
    gram = cfg.optimizer.dmuon.tp_distributed_gram
    mc = cfg.optimizer.muon  # the distributed Gram all-reduces one fp32 s×s Gram per restart segment of its NS
    gram_segments = 1 + len(gram_restarts(resolve_coefficients(mc.ns_coefficients, mc.ns_steps)))
    for dp in dps:  # each rank of a group records every broadcast/reduce segment of the shard group
        e = dp.group.dtype.itemsize  # the broadcasts move the packed params
        e_red = dp.group.reduce_dtype.itemsize  # the reduces move the grads cast to DMuon's reduce dtype
        expert = dp.fqn in experts
        G, col_of = (G_e, es_of) if expert else (N, s_of)
        if G > 1:
            elements["broadcast"] += (2 if z3 else 1) * frac(G) * dp.numel
            nbytes["broadcast"] += (2 if z3 else 1) * frac(G) * dp.numel * e
            elements["reduce"] += frac(G) * (dp.numel + 1)  # + its has-grad flag
            nbytes["reduce"] += frac(G) * (dp.numel + 1) * e_red
        column = col_of == dp.owner_shard
        if R > 1:
            elements["replicate_reduce"][column] += frac(R) * (dp.numel + 1)
            nbytes["replicate_reduce"][column] += frac(R) * (dp.numel + 1) * e_red
            elements["replicate_broadcast"][column] += frac(R) * dp.numel
            nbytes["replicate_broadcast"][column] += frac(R) * dp.numel * 4  # the fp32 master
        if expert:
            continue  # the EP shard holds whole experts: NS where it lives, no TP gather / scatter / Gram
        blocks = blocks_of[dp.fqn]
        if dp.tp_group is not None and T > 1 and not (blocks and heads_are_local(dp, blocks)):
            owners = column & (r_of == dp.owner_replicate)  # the T ranks of the DP owner's TP group
            m, n = dp.full_shape
            if gram and blocks is None and dp.shard_dim == (0 if m > n else 1 if n > m else -1):
                s = min(m, n)
                elements["tp_gram"][owners] += 2 * frac(T) * s * s * gram_segments
                nbytes["tp_gram"][owners] += 2 * frac(T) * s * s * gram_segments * 4
            else:
                full = dp.numel * T
                for k in ("tp_gather", "tp_scatter"):
                    elements[k][owners] += frac(T) * full
                    nbytes[k][owners] += frac(T) * full * 4  # fp32 update shards
    m_e = len(stacks)
    formula = {
        "broadcast": (2 if z3 else 1) * (frac(N) * p_m + frac(G_e) * p_e),
        "reduce (+ one has-grad flag per matrix, M)": frac(N) * (p_m + len(dense)) + frac(G_e) * (p_e + m_e),
        "replicate_reduce (per rank: (R-1)/R (P_col(shard) + M_col(shard)))": frac(R)
        * ((p_col + m_col)[s_of] + (pe_col + me_col)[es_of]),
        "replicate_broadcast (per rank)": frac(R) * (p_col[s_of] + pe_col[es_of]),
        "replicate row sum of replicate_reduce = (R-1)/R (P_M + M)": frac(R) * (p_m + len(dense)),
    }
    if stacks:
        key = "experts' replicate_reduce summed over the expert shards = (R-1)/R (P_E/EP + M_E)"
        formula[key] = frac(R) * (p_e + m_e)
    dmuon_total = sum(nbytes.values())
    # Naive FSDP2 + Muon and FSDP2 + AdamW on the Muon matrices (FSDP2 over the same N, the TP-local P_M; the
    # expert stacks, EP-local P_E, over the G_e ranks of the expert FSDP mesh, as apply_fsdp shards them).
    reshard = cfg.parallelism.fsdp_reshard_after_forward != "never"  # the blocks (they hold the Muon matrices)
    p_full = float(sum(dp.numel * (T if dp.tp_group is not None else 1) for dp in dense))
    all_gather = (2 if reshard else 1) * (frac(N) * p_m + frac(G_e) * p_e) * e_param
    reduce_scatter = (frac(N) * p_m + frac(G_e) * p_e) * e_reduce
    hsdp_all_reduce = 2 * frac(R) * (p_m / N + p_e / G_e) * e_reduce
    # full_tensor() of every fp32 Muon grad shard (shard and TP dims; an expert stack's EP and expert-shard dims)
    grad_all_gather = frac(N * T) * (p_full + p_e * E) * 4
    fsdp_adamw = all_gather + reduce_scatter + hsdp_all_reduce
    # The other params (embeddings, norms, output): FSDP2 in all three.
    one_row = r_of == 0  # a replicate row's N shard ranks hold each TP-local param once
    p_other = np.array([fsdp_numel[one_row & (coords["tp"] == tp)].sum() for tp in range(T)])[coords["tp"]]
    p_other_root = np.array([fsdp_root_numel[one_row & (coords["tp"] == tp)].sum() for tp in range(T)])[coords["tp"]]
    mode = cfg.parallelism.fsdp_reshard_after_forward
    ag_other = frac(N) * (
        p_other_root * (2 if mode == "always" else 1) + (p_other - p_other_root) * (1 if mode == "never" else 2)
    )
    other = ag_other * e_param + frac(N) * p_other * e_reduce + 2 * frac(R) * p_other / N * e_reduce
    return {
        "dmuon_elements": {k: _summary(v) for k, v in elements.items()},
        "dmuon_bytes": {k: _summary(v) for k, v in nbytes.items()},
        "dmuon_total_bytes": _summary(dmuon_total),
        "p_m_elements": p_m,
        "p_e_elements": p_e,
        "expert_stacks": m_e,
        "expert_shard_group": G_e if stacks else None,
        "packed_element_bytes": e_buf,
        "formula_elements": {k: _summary(np.broadcast_to(v, (W,)).astype(float)) for k, v in formula.items()},
        "naive_fsdp2_muon_bytes": {
            "all_gather": all_gather,
            "reduce_scatter": reduce_scatter,
            "replicate_all_reduce": hsdp_all_reduce,
            "grad_all_gather": grad_all_gather,
            "total": fsdp_adamw + grad_all_gather,
        },
        "fsdp2_adamw_bytes": {
            "all_gather": all_gather,
            "reduce_scatter": reduce_scatter,
            "replicate_all_reduce": hsdp_all_reduce,
            "total": fsdp_adamw,
        },
        "other_params_fsdp2_bytes": _summary(other),
    }


# ------------------------------------------------------------------------------------------------ output
def _row(label: str, s: dict | None, scale: float, unit: str, width: int = 46) -> str:
    if s is None:
        return f"  {label:<{width}} {'(no estimate for this family)':>36}"
    return f"  {label:<{width}} {s['min'] / scale:>10.3f} {s['median'] / scale:>11.3f} {s['max'] / scale:>11.3f} {unit}"


def format_plan(p: dict[str, Any]) -> str:
    c, mem, lpt, comm = p["config"], p["memory_bytes"], p["lpt"], p["bytes_per_step"]
    mesh, ep = c["mesh"], c.get("expert_parallel")
    in_shard = f" (efsdp {ep['efsdp']} x ep {ep['ep']})" if ep else ""
    lines = [
        f"Dry run: {c['model']}, {c['params']:,} params (vocab: {c['vocab']}), world {c['world_size']} = replicate "
        f"{mesh['replicate']} x shard {mesh['shard']}{in_shard} x tp {mesh['tp']} (fake process group, meta tensors)",
        f"  micro-batch {c['local_batch_size']} x {c['seq_len']} tokens per DP rank, AC {c['activation_checkpoint']}, "
        f"params {c['param_dtype']} / reduce {c['reduce_dtype']}, DMuon-{c['dmuon_mode']}, "
        f"FSDP2 reshard {c['fsdp_reshard_after_forward']}" + (", loss parallel" if c["loss_parallel"] else ""),
        "",
        p["layout"],
        "",
        f"  {'memory per rank':<46} {'min':>10} {'median':>11} {'max':>11}",
    ]
    unit, scale = ("GiB", GIB) if mem["peak_estimate"]["max"] >= GIB else ("MiB", MIB)
    labels = [
        ("fsdp_param_shards", "FSDP2 param shards (fp32)"),
        ("dmuon_fp32_masters", "DMuon fp32 masters (owner column)" if not ep else "DMuon fp32 masters (owner columns)"),
        ("muon_momentum", "Muon momentum (global owner, fp32)"),
        ("adamw_moments", "AdamW moments (FSDP2 params)"),
        ("gradients", "gradients (FSDP2 shards + owners' reduced)"),
        ("resident_total", "resident total"),
        ("dmuon_packed_transient_peak", f"DMuon packed buffers, {c['dmuon_mode']} transient peak"),
        ("fsdp_root_unsharded", "FSDP2 root unit gathered (params + grads)"),
        ("activations_estimate", f"activations (estimate, AC {c['activation_checkpoint']})"),
        ("peak_estimate", "peak (resident + transients + activations)"),
    ]
    lines += [_row(label, mem[key], scale, unit) for key, label in labels]
    if mem["activation_terms"] is not None:
        act = mem["activation_terms"]
        lines.append(
            "    of which: "
            + ", ".join(f"{ACTIVATION_TERMS[k]} {act[k] / scale:.3f}" for k in ACTIVATION_TERMS)
            + f" {unit} (the peak: blocks + max(head + its grads, recompute))"
        )
    lo = lpt["owners_per_layer"]
    first = ", ".join(
        (
            f"{'.'.join(fqn.rsplit('.', 2)[-2:])}->e({o['owner_shard']},{o['owner_replicate']})"
            if o.get("expert")
            else f"{fqn.rsplit('.', 2)[-2]}->({o['owner_shard']},{o['owner_replicate']}"
            + (f",tp{o['tp_owner']})" if mesh["tp"] > 1 else ")")
        )
        for fqn, o in lpt["first_layer"].items()
    )
    stacks = lpt.get("expert_stacks", 0)
    expert_slots = (
        f"; {stacks} of them expert stacks over {lpt['expert_slots']} expert slots (expert shard x replicate, each "
        f"stack's NS on its owner's {ep['ep'] if ep else 1} EP ranks; per expert slot max/bound "
        f"{lpt['expert_slot_max_over_lower_bound']:.3f})"
        if stacks
        else ""
    )
    ns = lpt["ns_flops_per_rank"]
    naive, adamw = comm["naive_fsdp2_muon_bytes"], comm["fsdp2_adamw_bytes"]
    bunit, bscale = ("GiB", GIB) if naive["total"] >= GIB else ("MiB", MIB)
    lines += [
        "",
        f"LPT plan: {lpt['matrices']} matrices in {lpt['layers']} layers over {lpt['slots']} DP owner slots "
        f"(shard x replicate){' x tp ' + str(mesh['tp']) if mesh['tp'] > 1 else ''}, NS {lpt['ns_steps']} steps"
        + expert_slots,
        f"  NS TFLOP per rank and step: max {ns['max'] / 1e12:.3f}, mean {lpt['ns_flops_mean'] / 1e12:.3f} "
        f"(max/mean {lpt['max_over_mean']:.3f}); certified lower bound {lpt['ns_flops_lower_bound'] / 1e12:.3f} "
        f"(max/bound {lpt['max_over_lower_bound']:.3f}; per DP slot {lpt['slot_max_over_lower_bound']:.3f})",
        f"  distinct owners per layer: min {lo['min']}, median {lo['median']:g}, max {lo['max']} "
        f"(of {lo['matrices_per_layer']} matrices); first layer (shard,replicate"
        + ("; e: expert shard,replicate" if stacks else "")
        + f"): {first}",
        f"  owner NS time per step at {lpt['tflops']:g} TFLOP/s: max {lpt['ns_time_s_max'] * 1e3:.2f} ms, "
        f"mean {lpt['ns_time_s_mean'] * 1e3:.2f} ms (naive FSDP2 + Muon: every rank runs all "
        f"{lpt['naive_ns_flops_per_rank'] / 1e12:.2f} TFLOP = {lpt['naive_ns_time_s'] * 1e3:.1f} ms)",
        "",
        f"Bytes per step per rank ({bunit}), the Muon matrices: P_M = {comm['p_m_elements']:,.0f} elements per TP rank"
        + (
            f"; expert stacks over the expert shard groups of G_e = {comm['expert_shard_group']} ranks: "
            f"P_E/EP = {comm['p_e_elements']:,.0f} elements per EP rank"
            if comm.get("expert_stacks")
            else ""
        ),
        f"  {'DMuon ledger kind':<46} {'min':>10} {'median':>11} {'max':>11}",
    ]
    fe = comm["formula_elements"]
    for kind, s in comm["dmuon_bytes"].items():
        if s["max"] == 0:
            continue
        lines.append(_row(kind, s, bscale, bunit))
    lines.append(_row("DMuon total", comm["dmuon_total_bytes"], bscale, bunit))
    check = {
        "broadcast": "broadcast",
        "reduce": "reduce (+ one has-grad flag per matrix, M)",
        "replicate_reduce": "replicate_reduce (per rank: (R-1)/R (P_col(shard) + M_col(shard)))",
        "replicate_broadcast": "replicate_broadcast (per rank)",
    }
    ok = all(
        np.allclose(comm["dmuon_elements"][k]["per_rank"], fe[f]["per_rank"], rtol=1e-12, atol=0)
        for k, f in check.items()
    )
    z = "2" if c["dmuon_mode"] == "Z3" else ""
    experts = (
        f'; the expert stacks\' (docs/dmuon.md, "Experts") added: broadcast {z}(G_e-1)/G_e P_E/EP, reduce '
        "(G_e-1)/G_e (P_E/EP + M_E), replicate_* (R-1)/R of the expert column's"
        if comm.get("expert_stacks")
        else ""
    )
    lines.append(
        f"  formulas (docs/dmuon.md): broadcast {z}(N-1)/N P_M, reduce (N-1)/N (P_M + M), replicate_* (R-1)/R "
        f"P_col(shard) (+ M_col){experts}: {'equal' if ok else 'DIFFERENT'}"
    )
    lines += [
        f"  {'naive FSDP2 + Muon':<46} {naive['total'] / bscale:>34.3f} {bunit}  (all-gather "
        f"{naive['all_gather'] / bscale:.2f} + reduce-scatter {naive['reduce_scatter'] / bscale:.2f} + replicate "
        f"all-reduce {naive['replicate_all_reduce'] / bscale:.2f} + grad all-gather "
        f"{naive['grad_all_gather'] / bscale:.2f}; NS on every rank)",
        f"  {'FSDP2 + AdamW':<46} {adamw['total'] / bscale:>34.3f} {bunit}  (all-gather, reduce-scatter, replicate "
        "all-reduce)",
        _row("other params (FSDP2: embeddings, norms, output)", comm["other_params_fsdp2_bytes"], bscale, bunit),
    ]
    a2a = comm.get("moe_all_to_all")
    if a2a is not None:
        lines.append(
            f"  {'MoE all-to-all (tokens; every optimizer)':<46} {a2a['total'] / bscale:>34.3f} {bunit}  (EP "
            f"{a2a['ep']}, uniform routing: {a2a['moe_layers']} MoE layers x {a2a['tokens_per_rank']:,} tokens x "
            f"top-{a2a['top_k']} x {a2a['dim']} x {a2a['element_bytes']} B x (EP-1)/EP, 4 ways = "
            f"{a2a['bytes'] / bscale:.2f} + AC recompute of {a2a['recomputed_layers']} layers "
            f"{a2a['ac_recompute_bytes'] / bscale:.2f} + expert counts {a2a['counts_bytes'] / bscale:.4f})"
        )
    lines += [
        "",
        f"Planned in {p['planner']['seconds']:.1f} s, {p['planner']['max_rss_bytes'] / GIB:.2f} GiB RSS",
    ]
    return "\n".join(lines)


def dry_run(cfg: JobConfig) -> int:
    """`train.py --job.dry_run`: plan, print, write the JSON; 0 when the plan fits the device, 2 when it does not
    (with the changes that would fit: AC, micro-batch, a larger TP degree, each planned)."""
    try:
        result = plan(cfg)
        print(format_plan(result), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not result["capacity"]["fits"]:
        result["capacity"]["alternatives"] += tp_alternatives(cfg, result)
    if cfg.job.dry_run_json:
        with open(cfg.job.dry_run_json, "w") as f:
            json.dump(result, f, indent=1)
        logger.info("Dry-run figures in %s", cfg.job.dry_run_json)
    verdict = format_capacity(result)
    print("\n" + verdict, flush=True)
    if not result["capacity"]["fits"]:
        cap = result["capacity"]
        print(
            f"error: the plan needs {cap['peak_bytes'] / GIB:.1f} GiB on rank {cap['rank']}, more than the "
            f"{cap['device_bytes'] / GIB:g} GiB device (job.dry_run_device_memory_gib): apply one of the changes "
            "listed above",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return 0


__all__ = [
    "Mesh",
    "build_on_fake_world",
    "check_device_memory",
    "dry_run",
    "plan_memory",
    "format_capacity",
    "format_plan",
    "plan",
    "tp_alternatives",
]
