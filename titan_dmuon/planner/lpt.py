"""The LPT plan as it runs: Newton-Schulz FLOPs per rank (`dmuon.costs`) against a certified lower bound, the owners
per layer, and the owners' NS time at a given TFLOP/s.

A dense matrix runs its NS on its DP owner: on its TP owner when TP-sharded ("gather" and "gram" paths), on each
TP rank of the owner for its own heads when its TP shards hold whole heads, on every TP rank of the owner when not
TP-sharded. An expert stack under EP runs on each EP rank of its owner, each on its own experts.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from titan_dmuon import dmuon
from titan_dmuon.components.model import ModelSpec
from titan_dmuon.config import JobConfig

from .memory import Placement
from .summary import summary


def plan_lpt(model: torch.nn.Module, spec: ModelSpec, cfg: JobConfig, placement: Placement) -> dict[str, Any]:
    dims, matrices = placement.dims, placement.matrices
    R, N, T, W, E, G_e = dims.dp_replicate, dims.dp_shard, dims.tp, dims.world_size, dims.ep, dims.expert_shard_size
    ns_steps = cfg.optimizer.muon.ns_steps
    # half the matmul FLOPs (the partitioner's unit); per-head Muon: blocks x a block's; an expert stack: experts x
    # an expert's
    cost = {m.fqn: m.ns_cost(ns_steps) for m in matrices}
    flops = {m.fqn: m.ns_flops(ns_steps) for m in matrices}
    ns_flops = np.zeros(W)
    jobs: list[float] = []
    for m in matrices:
        if m.expert:  # an expert stack under EP: each EP rank of its owner runs NS on its E/EP experts
            for ep in range(E):
                ns_flops[dims.expert_rank_of(m.owner_replicate, m.owner_shard, ep)] += flops[m.fqn] / E
                jobs.append(flops[m.fqn] / E)
            continue
        if m.shard_dim is not None and m.tp_path() == "local":  # per-head Muon, whole heads in each TP shard
            for tp in range(T):
                ns_flops[dims.rank_of(m.owner_replicate, m.owner_shard, tp)] += flops[m.fqn] / T
                jobs.append(flops[m.fqn] / T)
            continue
        for tp in [m.tp_owner] if m.shard_dim is not None else range(T):
            ns_flops[dims.rank_of(m.owner_replicate, m.owner_shard, tp)] += flops[m.fqn]
            jobs.append(flops[m.fqn])
    bound = dmuon.partition.makespan_lower_bound(jobs, W)
    # each LPT (the dense matrices over the R x N slots, the expert stacks over R x G_e) against its own bound
    slot_ratio = {}
    for kind, slots, items in (
        ("dense", R * N, [m for m in matrices if not m.expert]),
        ("experts", R * G_e, [m for m in matrices if m.expert]),
    ):
        slot_cost = np.zeros(slots)
        for m in items:
            slot_cost[m.owner_replicate * (slots // R) + m.owner_shard] += cost[m.fqn]
        slot_bound = dmuon.partition.makespan_lower_bound([cost[m.fqn] for m in items], slots)
        slot_ratio[kind] = float(slot_cost.max()) / slot_bound if slot_bound else 0.0
    block_names = sorted((fqn for fqn, _ in spec.blocks(model)), key=len, reverse=True)

    def layer_of(m: dmuon.costs.Matrix) -> str:  # the block a matrix is in (an expert stack's: its experts module)
        return next((b for b in block_names if m.fqn.startswith(f"{b}.")), m.hook)

    by_layer: dict[str, list[dmuon.costs.Matrix]] = {}
    for m in matrices:
        by_layer.setdefault(layer_of(m), []).append(m)
    owners_per_layer = [  # an expert slot is another rank than the dense slot of the same coordinates
        len({(d.expert, d.owner_shard, d.owner_replicate) for d in v}) for v in by_layer.values()
    ]
    first = next(iter(by_layer.values()), [])
    tflops = cfg.job.dry_run_tflops
    naive_flops = sum(flops.values())  # naive FSDP2 + Muon: every rank orthogonalizes every full matrix
    mean = float(ns_flops.mean())
    experts = sum(m.expert for m in matrices)

    def tp_owner(d: dmuon.costs.Matrix) -> int | None:  # the TP rank that runs its NS (an expert stack: each EP rank)
        return d.tp_owner if d.shard_dim is not None and not d.expert else None

    return {
        "matrices": len(matrices),
        "expert_stacks": experts,
        "layers": len(by_layer),
        "slots": R * N,
        "expert_slots": R * G_e if experts else 0,
        "ns_steps": ns_steps,
        "ns_flops_per_rank": summary(ns_flops),
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
                "expert": d.expert,
            }
            for d in first
        },
        "owners": {d.fqn: [d.owner_shard, d.owner_replicate, tp_owner(d)] for d in matrices},
        "tflops": tflops,
        "ns_time_s_max": float(ns_flops.max()) / (tflops * 1e12),
        "ns_time_s_mean": mean / (tflops * 1e12),
        "naive_ns_flops_per_rank": naive_flops,
        "naive_ns_time_s": naive_flops / (tflops * 1e12),
    }
