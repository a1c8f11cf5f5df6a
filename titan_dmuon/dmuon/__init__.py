"""DMuon: distributed Muon by dedicated ownership (public API; importing installs the FSDP2 patch).

from titan_dmuon import dmuon
dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
for layer in model.layers: fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, adamw_lr=1e-3)
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from . import partition
from .api import (
    _require_state,
    dedicate_params,
    dedicate_params_ddp,
    dedicate_params_ddp_tp,
    get_owned_params,
    replicate,
    replicate_tp,
)
from .checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .clip import clip_grad_norm_
from .fsdp2_patch import install_patch
from .muon import Muon
from .newton_schulz import get_ns_backend, zeropower_via_newtonschulz
from .param import DedicatedParam

install_patch()


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Skip gradient communication inside the block (grad accumulation): DMuon's reduces and FSDP2's.

    Local grads accumulate on every rank; the first backward outside the block reduces the sum.
    """
    from torch.distributed.fsdp import FSDPModule

    state = _require_state(model, "no_sync")
    ddp = getattr(model, "_dmuon_replicate", None)
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    if ddp is not None:
        ddp.sync_grads = False
    try:
        with state.no_sync():
            yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)
        if ddp is not None:
            ddp.sync_grads = True


def comm_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """What DMuon moved on this rank in the last completed step: elements and bytes per collective kind
    (the byte ledger; see docs/dmuon.md, "Bytes per step")."""
    ledger = _require_state(model, "comm_stats").ledger
    return {"elements": dict(ledger.last_step), "bytes": dict(ledger.last_step_bytes)}


def drain(model: nn.Module) -> None:
    """Wait for any DMuon communication still in flight (the HSDP/DDP post-step publish, deferred TP updates).

    Call it before reading the live params outside the training step or before destroying the process group.
    """
    _require_state(model, "drain").drain_publish()


__all__ = [
    "comm_stats",
    "drain",
    "DedicatedParam",
    "Muon",
    "clip_grad_norm_",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_params_ddp_tp",
    "get_model_state_dict",
    "get_ns_backend",
    "get_optimizer_state_dict",
    "get_owned_params",
    "install_patch",
    "no_sync",
    "partition",
    "replicate",
    "replicate_tp",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "zeropower_via_newtonschulz",
]
