"""Meta-device start (docs/dmuon.md, "Starting on the meta device"): `dedicate_params` on a meta model records
who owns what and allocates nothing; `init_dedicated_params` then allocates only what this rank holds and asks
the caller's `init_fn` for the values, so no rank ever builds a matrix it does not own.

The init function is the caller's (DMuon does not know the model's distributions): it receives the FQN, the
fp32 tensor to fill and the region of the full logical matrix that tensor holds (its TP shard under TP). For
the owner column to agree without a publish, `init_fn` must give the same values for the same (FQN, region)
on every rank, e.g. values drawn from generators seeded by (seed, FQN, position).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .group import InitFn
from .state import state_of


def init_dedicated_params(model: nn.Module, init_fn: InitFn, device: torch.device | str) -> None:
    """Allocate this rank's share of the dedicated params on `device` and fill it with `init_fn`.

    Call it once, after `dedicate_params` (and `fully_shard`) on a meta model and before `dmuon.Muon`. Each rank
    of an owner's column gets the fp32 master `_owned_data` of the matrix (its TP shard under TP), filled by
    `init_fn(fqn, out, region)`, where `region` is one slice per dim of the full matrix; every packed buffer
    gets its storage (freed until the first forward). Under DDP every rank allocates the live params. Nothing
    else is allocated: no rank holds a matrix it does not own.
    """
    state = state_of(model, "init_dedicated_params")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("init_dedicated_params: pass the device to allocate on (e.g. 'cuda:0' or 'cpu'), not meta")
    pending = [g for g in state.groups if g.on_meta]
    if not state.groups and state.device.type == "meta":  # allow_empty: nothing dedicated on this rank
        state.device = device
        return
    if not pending:
        raise RuntimeError(
            "init_dedicated_params: the dedicated params are not on the meta device (dedicate_params was given a "
            "materialized model, or init_dedicated_params already ran): nothing to initialize"
        )
    for group in pending:
        group.materialize(device, init_fn)
    state.device = device
