"""DMuon: distributed Muon by dedicated ownership (public API; importing installs the FSDP2 patch).

from titan_dmuon import dmuon
dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
for block in dmuon.fsdp_units(model): fully_shard(block, mesh=mesh)  # the rest joins the root unit
fully_shard(model, mesh=mesh)
optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, adamw_lr=1e-3)

dmuon.Muon's defaults are torch.optim.Muon's (dmuon.MuonOptions documents and checks every Muon option).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from . import costs, partition
from .api import (
    dedicate_params,
    dedicate_params_ddp,
    dedicate_params_ddp_tp,
    dedicated_matrices,
    describe_tp_paths,
    get_dedicated_params,
    get_owned_params,
    replicate,
    replicate_tp,
    tp_paths,
)
from .clip import clip_grad_norm_
from .ddp import replicate_no_sync
from .fsdp2_patch import install_patch
from .meta_init import init_dedicated_params
from .muon import Muon, adamw_step, adjusted_lr, init_adamw_state, momentum_update
from .newton_schulz import (
    Coefficients,
    cpu_has_native_bf16,
    default_ns_dtype,
    get_ns_backend,
    gram_restarts,
    resolve_coefficients,
    zeropower_via_newtonschulz,
)
from .options import DTYPES, MuonOptions, OptionError, to_dtype
from .param import DedicatedParam
from .qk_clip import QKClip, QKHeads, max_logit_per_head, report_max_logit
from .state import state_of, unwrap
from .state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .units import fsdp_units

install_patch()


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient communication inside the block (grad accumulation): DMuon's reduces, FSDP2's,
    `replicate`'s, and, for a model wrapped in torch's DistributedDataParallel, DDP's own `no_sync()`.

    Local grads accumulate on every rank; the first backward outside the block reduces the sum. Put the
    forward inside the block too (DDP's rule).
    """
    state = state_of(model, "no_sync")
    module = unwrap(model)
    with contextlib.ExitStack() as stack:
        if model is not module:  # torch DDP's own switch
            stack.enter_context(model.no_sync())
        stack.enter_context(_fsdp_no_sync(module))
        stack.enter_context(replicate_no_sync(module))
        stack.enter_context(state.no_sync())
        yield


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    """FSDP2's gradient reduce-scatter off inside the block, on every FSDP2 module of `module`."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)


def reduce_grads(model: nn.Module) -> None:
    """Reduce the grads that backwards under `no_sync` accumulated, now (to their owners; FSDP2's reduce-scatter is
    the caller's): for a pipeline schedule, which runs every microbatch's backward under `no_sync` and, with a
    zero-bubble schedule, computes the weight grads after the backward of the inputs, so no backward's end is the
    point where a group's grads are complete. Every rank of the model's DP slices calls it at the same point."""
    state_of(model, "reduce_grads").reduce_now()


def comm_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """What DMuon moved on this rank in the last completed step: elements and bytes per collective kind
    (the byte ledger; see docs/dmuon.md, "Bytes per step")."""
    ledger = state_of(model, "comm_stats").ledger
    return {"elements": dict(ledger.last_step), "bytes": dict(ledger.last_step_bytes)}


def drain(model: nn.Module) -> None:
    """Wait for any DMuon communication still in flight (the HSDP/DDP post-step publish, deferred TP updates).

    Call it before reading the live params outside the training step or before destroying the process group.
    """
    state_of(model, "drain").drain_publish()


__all__ = [
    "comm_stats",
    "drain",
    "fsdp_units",
    "DTYPES",
    "Coefficients",
    "DedicatedParam",
    "Muon",
    "MuonOptions",
    "OptionError",
    "QKClip",
    "QKHeads",
    "adamw_step",
    "adjusted_lr",
    "cpu_has_native_bf16",
    "default_ns_dtype",
    "init_adamw_state",
    "momentum_update",
    "to_dtype",
    "clip_grad_norm_",
    "costs",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_params_ddp_tp",
    "dedicated_matrices",
    "describe_tp_paths",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_ns_backend",
    "get_optimizer_state_dict",
    "get_owned_params",
    "gram_restarts",
    "init_dedicated_params",
    "install_patch",
    "max_logit_per_head",
    "no_sync",
    "partition",
    "reduce_grads",
    "replicate",
    "replicate_tp",
    "report_max_logit",
    "resolve_coefficients",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "tp_paths",
    "zeropower_via_newtonschulz",
]
