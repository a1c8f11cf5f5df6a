"""Bytes per step per rank: DMuon's ledger kinds (docs/dmuon.md, "Bytes per step" and "Experts"), the formulas
next to them, and on the same mesh naive FSDP2 + Muon and FSDP2 + AdamW; with MoE layers, their token all-to-all.

DMuon's figures are the library's cost model (`dmuon.costs`) summed over the model's dedicated matrices, each on
the ranks it moves on: its shard group's broadcasts and reduces on every rank of the group (an expert stack's: the
G_e ranks of its expert shard group), its replicate reduce and publish on its owner column, its TP gather/scatter
or distributed Gram on the TP ranks of its DP owner. The ledger of a real run (`dmuon.comm_stats`) records the same
figures; tests/distributed/test_planner.py holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from titan_dmuon import dmuon
from titan_dmuon.components.model import ModelSpec
from titan_dmuon.components.moe import moe_layers
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.parallel import ParallelDims
from titan_dmuon.parallel.expert_parallel import all_to_all_bytes
from titan_dmuon.parallel.parallelize import ac_plan

from .memory import Placement
from .settings import CommSettings
from .summary import summary

costs = dmuon.costs

# The docs/dmuon.md formulas, by the name the plan prints them under (the report checks the ledger kinds to these).
FORMULA_OF_KIND = {
    "broadcast": "broadcast",
    "reduce": "reduce (+ one has-grad flag per matrix, M)",
    "replicate_reduce": "replicate_reduce (per rank: (R-1)/R (P_col(shard) + M_col(shard)))",
    "replicate_broadcast": "replicate_broadcast (per rank)",
}


@dataclass(frozen=True)
class Totals:
    """The dedicated matrices' element counts the formulas take (TP-local; the expert stacks EP-local)."""

    p_m: float  # the dense matrices' elements
    m: int  # how many dense matrices
    p_e: float  # the expert stacks' elements, per EP rank
    m_e: int  # how many expert stacks
    p_col: np.ndarray  # per shard column: the dense elements owned there
    m_col: np.ndarray  # and how many matrices
    pe_col: np.ndarray  # per expert shard column: the expert stacks' elements owned there
    me_col: np.ndarray

    @classmethod
    def of(cls, matrices: list[dmuon.costs.Matrix], dims: ParallelDims) -> Totals:
        dense = [m for m in matrices if not m.expert]
        stacks = [m for m in matrices if m.expert]
        p_col, m_col = np.zeros(dims.dp_shard), np.zeros(dims.dp_shard)
        pe_col, me_col = np.zeros(dims.expert_shard_size), np.zeros(dims.expert_shard_size)
        for m in matrices:
            pc, mc = (pe_col, me_col) if m.expert else (p_col, m_col)
            pc[m.owner_shard] += m.numel
            mc[m.owner_shard] += 1
        return cls(
            p_m=float(sum(m.numel for m in dense)),
            m=len(dense),
            p_e=float(sum(m.numel for m in stacks)),
            m_e=len(stacks),
            p_col=p_col,
            m_col=m_col,
            pe_col=pe_col,
            me_col=me_col,
        )


def dmuon_ledger(placement: Placement, settings: CommSettings) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(elements, bytes) per ledger kind and rank of a steady-state step: every matrix's `dmuon.costs` figures on the
    ranks it moves on."""
    dims, coords, z3 = placement.dims, placement.coords, placement.z3
    W, R, N, G_e = dims.world_size, dims.dp_replicate, dims.dp_shard, dims.expert_shard_size
    s_of, r_of, es_of = coords["shard"], coords["replicate"], coords["expert_shard"]
    everyone = np.ones(W, dtype=bool)
    elements = {k: np.zeros(W) for k in costs.KINDS}
    nbytes = {k: np.zeros(W) for k in costs.KINDS}
    for m in placement.matrices:
        G, col_of = (G_e, es_of) if m.expert else (N, s_of)
        column = col_of == m.owner_shard  # the ranks of its owner column
        tp = costs.Traffic()
        if not m.expert:  # an EP shard holds whole experts: NS where it lives, no TP traffic
            path = settings.tp_decision(m).path
            if path == "gram":
                tp = costs.tp_gram(min(m.full_shape), m.tp_size, settings.gram_restarts)
            elif path == "gather":
                tp = costs.tp_update(m.numel * m.tp_size, m.tp_size)
        owners = column & (r_of == m.owner_replicate)  # the TP ranks of its DP owner
        for ranks, traffic in (
            (everyone, costs.shard_axis(m.numel, G, z3=z3)),  # each rank of its shard group
            (column, costs.replicate_axis(m.numel, R)),
            (owners, tp),
        ):
            in_bytes = traffic.bytes(m.param_itemsize, m.reduce_itemsize)
            for k in costs.KINDS:
                if getattr(traffic, k):
                    elements[k][ranks] += getattr(traffic, k)
                    nbytes[k][ranks] += getattr(in_bytes, k)
    return elements, nbytes


def dmuon_formulas(totals: Totals, placement: Placement) -> dict[str, np.ndarray | float]:
    """docs/dmuon.md's closed forms, per rank: the shard axis on P_M over N (+ P_E/EP over G_e), the replicate axis
    on the rank's owner columns, and the replicate row sums."""
    dims, coords, z3 = placement.dims, placement.coords, placement.z3
    R, N, G_e = dims.dp_replicate, dims.dp_shard, dims.expert_shard_size
    s_of, es_of = coords["shard"], coords["expert_shard"]
    t = totals
    shard = costs.shard_axis(t.p_m, N, z3=z3, matrices=t.m) + costs.shard_axis(t.p_e, G_e, z3=z3, matrices=t.m_e)
    column = costs.replicate_axis(
        t.p_col[s_of] + t.pe_col[es_of], R, matrices=t.m_col[s_of] + t.me_col[es_of]
    )  # arrays: per rank
    formula = {
        FORMULA_OF_KIND["broadcast"]: shard.broadcast,
        FORMULA_OF_KIND["reduce"]: shard.reduce,
        FORMULA_OF_KIND["replicate_reduce"]: column.replicate_reduce,
        FORMULA_OF_KIND["replicate_broadcast"]: column.replicate_broadcast,
        "replicate row sum of replicate_reduce = (R-1)/R (P_M + M)": costs.replicate_axis(
            t.p_m, R, matrices=t.m
        ).replicate_reduce,
    }
    if t.m_e:
        key = "experts' replicate_reduce summed over the expert shards = (R-1)/R (P_E/EP + M_E)"
        formula[key] = costs.replicate_axis(t.p_e, R, matrices=t.m_e).replicate_reduce
    return formula


def fsdp2_matrices(
    totals: Totals, placement: Placement, settings: CommSettings
) -> tuple[dict[str, float], dict[str, float]]:
    """Naive FSDP2 + Muon and FSDP2 + AdamW on the Muon matrices (FSDP2 over the same N, the TP-local P_M; the
    expert stacks, EP-local P_E, over the G_e ranks of the expert FSDP mesh, as apply_fsdp shards them), bytes per
    rank: (naive, adamw)."""
    dims = placement.dims
    R, N, T, E, G_e = dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep, dims.expert_shard_size
    e_param, e_reduce = placement.param_itemsize, placement.reduce_itemsize
    frac = lambda k: (k - 1) / k  # noqa: E731 - the per-rank share of a collective over k ranks
    p_m, p_e = totals.p_m, totals.p_e
    reshard = settings.fsdp_reshard_after_forward != "never"  # the blocks (they hold the Muon matrices)
    p_full = float(sum(m.numel * m.tp_size for m in placement.matrices if not m.expert))
    all_gather = (2 if reshard else 1) * (frac(N) * p_m + frac(G_e) * p_e) * e_param
    reduce_scatter = (frac(N) * p_m + frac(G_e) * p_e) * e_reduce
    hsdp_all_reduce = 2 * frac(R) * (p_m / N + p_e / G_e) * e_reduce
    # full_tensor() of every fp32 Muon grad shard (shard and TP dims; an expert stack's EP and expert-shard dims)
    grad_all_gather = frac(N * T) * (p_full + p_e * E) * dmuon.costs.MASTER_ITEMSIZE
    fsdp_adamw = all_gather + reduce_scatter + hsdp_all_reduce
    naive = {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "replicate_all_reduce": hsdp_all_reduce,
        "grad_all_gather": grad_all_gather,
        "total": fsdp_adamw + grad_all_gather,
    }
    adamw = {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "replicate_all_reduce": hsdp_all_reduce,
        "total": fsdp_adamw,
    }
    return naive, adamw


def fsdp2_other_params(placement: Placement, settings: CommSettings) -> np.ndarray:
    """Per rank, the bytes FSDP2 moves for the params DMuon does not take (embeddings, norms, output): the same under
    all three optimizers. The blocks' units are all-gathered in forward (and again in backward unless
    "never"), the root unit once (twice with "always"); everything reduce-scattered, and all-reduced over the
    replicas."""
    dims, coords = placement.dims, placement.coords
    R, N, T = dims.dp_replicate, dims.dp_shard, dims.tp
    e_param, e_reduce = placement.param_itemsize, placement.reduce_itemsize
    frac = lambda k: (k - 1) / k  # noqa: E731
    one_row = coords["replicate"] == 0  # a replicate row's N shard ranks hold each TP-local param once
    tp_of = coords["tp"]
    p_other = np.array([placement.fsdp_numel[one_row & (tp_of == tp)].sum() for tp in range(T)])[tp_of]
    p_other_root = np.array([placement.fsdp_root_numel[one_row & (tp_of == tp)].sum() for tp in range(T)])[tp_of]
    mode = settings.fsdp_reshard_after_forward
    ag_other = frac(N) * (
        p_other_root * (2 if mode == "always" else 1) + (p_other - p_other_root) * (1 if mode == "never" else 2)
    )
    return ag_other * e_param + frac(N) * p_other * e_reduce + 2 * frac(R) * p_other / N * e_reduce


def bytes_per_step(placement: Placement, settings: CommSettings) -> dict[str, Any]:
    """Per rank, what DMuon's ledger records in a steady-state step, the formulas, and the other two optimizers on the
    same mesh (the Muon matrices; the other params apart)."""
    W = placement.dims.world_size
    totals = Totals.of(placement.matrices, placement.dims)
    elements, nbytes = dmuon_ledger(placement, settings)
    formula = dmuon_formulas(totals, placement)
    naive, adamw = fsdp2_matrices(totals, placement, settings)
    e_buf = placement.matrices[0].param_itemsize if placement.matrices else placement.param_itemsize
    return {
        "dmuon_elements": {k: summary(v) for k, v in elements.items()},
        "dmuon_bytes": {k: summary(v) for k, v in nbytes.items()},
        "dmuon_total_bytes": summary(sum(nbytes.values())),
        "p_m_elements": totals.p_m,
        "p_e_elements": totals.p_e,
        "expert_stacks": totals.m_e,
        "expert_shard_group": placement.dims.expert_shard_size if totals.m_e else None,
        "packed_element_bytes": e_buf,
        "formula_elements": {k: summary(np.broadcast_to(v, (W,)).astype(float)) for k, v in formula.items()},
        "naive_fsdp2_muon_bytes": naive,
        "fsdp2_adamw_bytes": adamw,
        "other_params_fsdp2_bytes": summary(fsdp2_other_params(placement, settings)),
        # each TP-sharded dense matrix's path, as dmuon.Muon decides it (the tp_* bytes above follow it)
        "tp_paths": {m.fqn: settings.tp_decision(m).path for m in placement.matrices if tp_sharded(m)},
        "tp_distributed_gram": settings.tp_distributed_gram,
        "tp_distributed_gram_policy": settings.tp_distributed_gram_policy,
    }


def tp_sharded(m: costs.Matrix) -> bool:
    """A dense matrix split over the TP ranks (an expert stack's EP shard holds whole experts: no TP path)."""
    return not m.expert and m.shard_dim is not None


# ------------------------------------------------------------------------------------------------ MoE layers
def _moe_layers(model: torch.nn.Module, spec: ModelSpec) -> list[tuple[int, torch.nn.Module]]:
    """(block index, MoE layer) of every MoE layer, in forward order (titan_dmuon/components/moe.py)."""
    return [(i, m) for i, (_, block) in enumerate(spec.blocks(model)) for m in moe_layers(block)]


def moe_all_to_all(
    model: torch.nn.Module, spec: ModelSpec, cfg: JobConfig, dims: ParallelDims, e_param: int
) -> dict[str, Any] | None:
    """The MoE layers' token all-to-all per rank and step (the same under every optimizer), uniform routing:
    `expert_parallel.all_to_all_bytes` (forward dispatch and combine, and their grads in backward), plus the
    forward's two again in each checkpointed block (activation checkpointing recomputes it), plus each
    dispatch's exchange of the int64 expert counts. A rank routes its own sequence chunk under TP (sequence
    parallelism): its tokens are micro-batch x seq_len / T per micro-batch. None for a model without MoE layers."""
    layers = _moe_layers(model, spec)
    if not layers:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint
    tokens = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps // dims.tp
    chosen, _ = ac_plan(ac.mode, ac.selective_ac_option, len(spec.blocks(model)))
    recomputed = sum(1 for i, _ in layers if i in set(chosen))
    shapes = {(int(m.top_k), int(m.num_experts), int(m.experts.w1.shape[-1])) for _, m in layers}
    if len(shapes) != 1:
        raise ConfigError(f"the planner models MoE layers of one shape (top-k, experts, dim), got {sorted(shapes)}")
    top_k, num_experts, dim = shapes.pop()
    E = dims.ep
    forward_backward = all_to_all_bytes(tokens, top_k, dim, E, e_param, len(layers))
    recompute = all_to_all_bytes(tokens, top_k, dim, E, e_param, recomputed) / 2
    micro_batches = t.gradient_accumulation_steps
    counts = (len(layers) + recomputed) * micro_batches * num_experts * 8 * (E - 1) / E
    return {
        "ep": E,
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
