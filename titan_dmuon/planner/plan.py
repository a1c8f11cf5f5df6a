"""The dry run: build the run's model and placement on a fake world, plan it, print it, and the checks built on
the plan (a real run's memory check; the larger TP degrees a plan that does not fit is re-planned with)."""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from titan_dmuon.components.model import ModelSpec, build_meta_model, check_flavor, get_model_spec, model_vocab_size
from titan_dmuon.components.moe import moe_layers
from titan_dmuon.components.optimizer import build_optimizer_component
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.dtypes import to_dtype
from titan_dmuon.parallel import ParallelDims, parallelize
from titan_dmuon.parallel.layout import describe_layout
from titan_dmuon.parallel.pipeline import keep_stages, plan_stages, stage_ids, stage_slices

from .communication import CommSettings, bytes_per_step, moe_all_to_all
from .lpt import plan_lpt
from .memory import WARN_FRACTION, ac_label, plan_memory
from .report import format_capacity, format_plan
from .summary import GIB

logger = logging.getLogger(__name__)


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
    """Rank 0 of a fake world: the meta model with the real TP / DMuon / FSDP2 placement (the trainer's code); under
    a pipeline, the part pp rank 0 holds (`build_part` builds the others' on the same world)."""
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
    # torch 2.13 registers the "fake" backend only in this module of its testing package (no public home)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    dims.build_mesh("cpu")
    model = build_meta_model(spec, cfg, vocab)
    nparams, flops_per_token = spec.nparams_and_flops(model, cfg.training.seq_len)
    info = {"params": nparams, "flops_per_token": flops_per_token, "vocab": vocab_source, "vocab_size": vocab}
    return build_part(cfg, spec, dims, vocab, 0, component), spec, dims, info


def build_part(
    cfg: JobConfig, spec: ModelSpec, dims: ParallelDims, vocab: int | None, pp_rank: int, component=None
) -> torch.nn.Module:
    """The parallelized meta model of pp rank `pp_rank`'s stages (the whole model without a pipeline), on the fake
    world `build_on_fake_world` made: every stage's ranks are laid out alike, so rank 0's meshes place any stage."""
    model = build_meta_model(spec, cfg, vocab)
    has_moe = bool(moe_layers(model))  # the whole model's: a stage may hold no MoE layer
    if dims.pp_enabled:
        stages = plan_stages(cfg, len(spec.blocks(model)))
        ids = stage_ids(pp_rank, dims.pp, len(stages), cfg.parallelism.pipeline_parallel_schedule)
        keep_stages(model, stage_slices(stages, ids))
    component = component or build_optimizer_component(cfg, spec)
    return parallelize(model, dims, dims.meshes.world, cfg, spec, component, whole_model_has_moe=has_moe)


def plan(cfg: JobConfig, world_size: int | None = None) -> dict[str, Any]:
    """Every figure of the dry run as a JSON-able dict (`format_plan` prints it)."""
    world_size = world_size or cfg.job.dry_run_world_size or cfg.job.dry_run_nodes * cfg.job.dry_run_gpus_per_node
    started = time.perf_counter()
    model, spec, dims, info = build_on_fake_world(cfg, world_size)
    memory, capacity, placement = plan_memory(model, spec, dims, cfg)
    pipeline = None
    if dims.pp_enabled:  # every pp rank's part planned; the sections below are the largest one's
        pipeline, worst = plan_pipeline(cfg, spec, dims, info["vocab_size"], model, (memory, capacity, placement))
        model, (memory, capacity, placement) = worst
    lpt = plan_lpt(model, spec, cfg, placement)
    comm = bytes_per_step(placement, CommSettings.from_config(cfg))
    comm["moe_all_to_all"] = moe_all_to_all(model, spec, cfg, dims, placement.param_itemsize)
    t, W, E = cfg.training, dims.world_size, dims.ep
    ep = {"ep": E, "efsdp": dims.efsdp, "expert_shard": dims.expert_shard_size} if E > 1 else None
    elapsed = time.perf_counter() - started
    return {
        "config": {
            "model": f"{cfg.model.name}/{cfg.model.flavor}",
            "params": info["params"],
            "vocab": info["vocab"],
            "world_size": W,
            "mesh": {"pp": dims.pp, "replicate": dims.dp_replicate, "shard": dims.dp_shard, "tp": dims.tp},
            "expert_parallel": ep,
            "local_batch_size": t.local_batch_size,
            "seq_len": t.seq_len,
            "activation_checkpoint": ac_label(cfg),
            "loss_parallel": dims.tp > 1 and not cfg.parallelism.disable_loss_parallel,
            "param_dtype": t.mixed_precision_param,
            "reduce_dtype": t.mixed_precision_reduce,
            "dmuon_mode": "Z3" if placement.z3 else "Z2",
            "fsdp_reshard_after_forward": cfg.parallelism.fsdp_reshard_after_forward,
        },
        "layout": describe_layout(dims, [f"node{g // cfg.job.dry_run_gpus_per_node}" for g in range(W)]),
        "memory_bytes": memory,
        "capacity": capacity,
        "lpt": lpt,
        "bytes_per_step": comm,
        "pipeline": pipeline,
        "planner": {"seconds": elapsed, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
    }


def plan_pipeline(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims, vocab, first, first_plan) -> tuple[dict, tuple]:
    """Every pp rank's part planned (its stages, modules, peak, activations and the microbatches they hold, the
    bytes it sends its neighbours, DMuon's bytes), the schedule's bubble, and the largest part with its plan."""
    from .pipeline import bubble_fraction, in_flight, p2p_bytes

    p, t = cfg.parallelism, cfg.training
    schedule, mb = p.pipeline_parallel_schedule, p.pipeline_parallel_microbatch_size
    stages = plan_stages(cfg, int(first.args.n_layers))  # `first` is pp rank 0's part: its args are the model's
    v, m = len(stages) // dims.pp, t.local_batch_size * t.gradient_accumulation_steps // mb
    length = t.seq_len // dims.tp if dims.tp > 1 else t.seq_len
    dim = int(first.args.dim)
    activation = mb * length * dim * to_dtype(t.mixed_precision_param).itemsize  # per microbatch and boundary
    settings = CommSettings.from_config(cfg)
    ranks, worst, worst_peak = [], None, -1.0
    for r in range(dims.pp):
        model = first if r == 0 else build_part(cfg, spec, dims, vocab, r)
        planned = first_plan if r == 0 else plan_memory(model, spec, dims, cfg, pp_rank=r)
        memory, capacity, placement = planned
        peak = float(memory["peak_estimate"]["max"])
        comm = bytes_per_step(placement, settings)
        dmuon_bytes = float(comm["dmuon_total_bytes"]["max"])
        if placement.z3:  # Z3 frees a group after each microbatch's forward: broadcast again per microbatch
            dmuon_bytes += (m - 1) * float(comm["dmuon_bytes"].get("broadcast", {"max": 0.0})["max"])
        ids = stage_ids(r, dims.pp, len(stages), schedule)
        ranks.append(
            {
                "pp_rank": r,
                "stages": {str(i): stages[i] for i in ids},
                "peak_bytes": peak,
                "activations_bytes": float((memory["activations_estimate"] or {"max": 0.0})["max"]),
                "microbatches_in_flight": in_flight(schedule, dims.pp, r, m, v),
                "p2p_send_bytes": p2p_bytes(schedule, dims.pp, len(stages), r, m, activation),
                "dmuon_bytes": dmuon_bytes,
                "muon_matrices": len(placement.matrices),
            }
        )
        if peak > worst_peak:
            worst, worst_peak = (model, planned), peak
            capacity["rank"] = r * dims.stage_size + capacity["rank"] % dims.stage_size  # in that stage's ranks
    summary = {
        "schedule": schedule,
        "stages": len(stages),
        "stages_per_rank": v,
        "microbatches": m,
        "microbatch_size": mb,
        "bubble_fraction": bubble_fraction(schedule, dims.pp, m, v),
        "activation_bytes_per_microbatch": activation,
        "ranks": ranks,
        "warnings": [
            f"{m} microbatches for {len(stages)} stages: torch's schedules need at least as many microbatches as "
            "stages (raise training.local_batch_size or lower parallelism.pipeline_parallel_microbatch_size)"
        ]
        if m < len(stages)
        else [],
    }
    return summary, worst


def tp_alternatives(cfg: JobConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Larger TP degrees (x2, x4, ... within a node, dividing the heads), each planned anew on the same world (the
    shard degree shrinks to match), up to the first that fits. Call it with no process group (it makes its own)."""
    mesh, device = result["config"]["mesh"], cfg.job.dry_run_device_memory_gib * GIB
    world, out = result["config"]["world_size"], []
    tp = mesh["tp"] * 2
    while tp <= cfg.job.dry_run_gpus_per_node and world % (tp * mesh["replicate"] * mesh.get("pp", 1)) == 0:
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
    pp_rank = rank // dims.stage_size
    memory, capacity, _ = plan_memory(model, spec, dims, cfg, device_bytes=free, rank=rank, pp_rank=pp_rank)
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
