"""The profiler labels of DMuon's phases, in one place.

Each phase's code runs inside `phase(NAME)`, a `torch.profiler.record_function` range: the chrome trace that
`profiling.enable_profiling` writes (one per rank) then names where a DMuon step's time goes. The range marks the
CPU-side issue of a phase; on CUDA its collectives and kernels complete later, on their streams. No sync, no
allocation; with no profiler running, `phase` is a null context (a `record_function` would still cost ~10 us).
"""

from __future__ import annotations

import contextlib

import torch

PACK = "dmuon/pack"  # pre-forward: the owners' params copied into the group's packed buffer, its broadcast issued
BROADCAST_WAIT = "dmuon/broadcast_wait"  # the forward (or backward) waits for the group's broadcast
REDUCE = "dmuon/reduce"  # backward: the grads packed and reduced to their owners (both stages)
NEWTON_SCHULZ = "dmuon/newton_schulz"  # the step's Newton-Schulz, on the owners (TP: the TP owner)
PUBLISH = "dmuon/publish"  # after the update: the owners' params broadcast over the replicate axis (HSDP, DDP)
TP_GATHER = "dmuon/tp_gather"  # TP: the gather of a matrix's shards onto its TP owner issued (from the backward)
TP_GATHER_WAIT = "dmuon/tp_gather_wait"  # TP: the step (or a clear of the grad) waits for that gather
TP_SCATTER = "dmuon/tp_scatter"  # TP: the scatter of the orthogonalized shards, issued then waited for
QK_CLIP = "dmuon/qk_clip"  # QK-clip: the attention logit clip of the query/key matrices

PHASES = (PACK, BROADCAST_WAIT, REDUCE, NEWTON_SCHULZ, PUBLISH, TP_GATHER, TP_GATHER_WAIT, TP_SCATTER, QK_CLIP)


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named `name` (one of `PHASES`) around a DMuon phase, so that the chrome trace of
    `profiling.enable_profiling` names each phase: `torch.profiler.record_function(name)` while a profiler
    records, else a null context (a context manager, one use each)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


__all__ = [
    "BROADCAST_WAIT",
    "NEWTON_SCHULZ",
    "PACK",
    "PHASES",
    "PUBLISH",
    "QK_CLIP",
    "REDUCE",
    "TP_GATHER",
    "TP_GATHER_WAIT",
    "TP_SCATTER",
    "phase",
]
