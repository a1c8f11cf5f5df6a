"""Full, FQN-keyed model and optimizer state dicts (keys as a plain `model.state_dict()`).

Getters drain pending async publishes first, then assemble full tensors on every rank: a dedicated
matrix comes from its owner (broadcast), an FSDP2/TP DTensor through `full_tensor()`. Setters take
the same full dicts and keep only what each rank holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from . import tp as _tp
from .param import DedicatedParam
from .state import state_of, unwrap


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _owner_tensor(state, dp: DedicatedParam, tensor: torch.Tensor | None, *, on_column: bool) -> torch.Tensor:
    """The full fp32 matrix behind a (TP-local) tensor held by the owner's column (`on_column`) or by the
    global owner alone, on every rank: replicate-axis broadcast to the column, shard-axis broadcast to
    each row, TP all-gather. Collectives follow the group order every rank shares."""
    holder = dp.in_owner_column if on_column else dp.is_owner
    out = (
        tensor.detach().float().clone()
        if holder
        else torch.empty(dp._orig_size, dtype=torch.float32, device=dp.local.device)
    )
    if not on_column and state.replicate_group is not None and dp.in_owner_column:
        dist.broadcast(out, src=state.replicate_global_rank(dp.owner_replicate), group=state.replicate_group)
    if state.shard_group is not None:
        dist.broadcast(out, src=state.shard_global_rank(dp.owner_shard), group=state.shard_group)
    return _tp.full_from_shards(out, dp)


def _local_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        return distribute_tensor(full.detach().to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)
    return full.detach().to(dtype=like.dtype, device=like.device)


def get_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    state = state_of(model, "get_model_state_dict")
    model = unwrap(model)
    state.drain_publish()
    out: dict[str, torch.Tensor] = {}
    for fqn, t in model.state_dict(keep_vars=True).items():
        dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
        out[fqn] = _owner_tensor(state, dp, dp._owned_data, on_column=True) if dp is not None else _full(t)
    return out


def set_model_state_dict(model: nn.Module, sd: dict[str, Any]) -> None:
    state = state_of(model, "set_model_state_dict")
    model = unwrap(model)
    state.drain_publish()
    state.reshard_all()
    current = model.state_dict(keep_vars=True)
    missing = sorted(set(current) - set(sd))
    unexpected = sorted(set(sd) - set(current))
    if missing or unexpected:
        raise KeyError(f"set_model_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    with torch.no_grad():
        for fqn, t in current.items():
            full = sd[fqn]
            if tuple(full.shape) != tuple(t.shape):
                raise ValueError(
                    f"set_model_state_dict: '{fqn}' has shape {tuple(full.shape)}, the model "
                    f"expects {tuple(t.shape)} (a checkpoint from another model config?)"
                )
            dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
            if dp is not None:
                if dp.in_owner_column:
                    dp._owned_data.copy_(_tp.shard_of_full(full, dp))
                if dp.group.live and dp._owned_data.data_ptr() != dp.local.data_ptr():
                    dp.local.data.copy_(dp._owned_data)
            elif isinstance(t, DTensor):
                t.to_local().copy_(_local_like(full, t).to_local())
            else:
                t.copy_(full)


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = state_of(model, "get_optimizer_state_dict")
    model = unwrap(model)
    state.drain_publish()
    names = {p: n for n, p in model.named_parameters()}
    # which dedicated params have a momentum buffer yet (it lives on the owners only): one all-reduce
    has = torch.tensor(
        [int(dp.is_owner and "momentum_buffer" in optimizer.state.get(dp.param, {})) for dp in state.dparams],
        dtype=torch.int64,
    )
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    has_momentum = {dp.param for dp, h in zip(state.dparams, has.tolist(), strict=True) if h}
    out_state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = []
        for p in group["params"]:
            fqn = names[p]
            fqns.append(fqn)
            dp = state.by_param.get(p)
            if dp is not None:
                if p in has_momentum:
                    buf = optimizer.state[p]["momentum_buffer"] if dp.is_owner else None
                    out_state[fqn] = {"momentum_buffer": _owner_tensor(state, dp, buf, on_column=False)}
            elif optimizer.state.get(p):
                out_state[fqn] = {
                    k: _full(v)
                    if isinstance(v, torch.Tensor) and v.ndim > 0
                    else (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in optimizer.state[p].items()
                }
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": out_state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    state = state_of(model, "set_optimizer_state_dict")
    model = unwrap(model)
    state.drain_publish()
    params = dict(model.named_parameters())
    if len(sd["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"set_optimizer_state_dict: the checkpoint has {len(sd['param_groups'])} param groups, "
            f"the optimizer {len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, sd["param_groups"], strict=True):
        mine = [n for n, p in params.items() if any(p is q for q in group["params"])]
        if sorted(mine) != sorted(saved["params"]):
            raise ValueError("set_optimizer_state_dict: param groups differ from the checkpoint's")
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    for fqn, entry in sd["state"].items():
        p = params[fqn]
        dp = state.by_param.get(p)
        if dp is not None:
            if dp.is_owner:
                full = entry["momentum_buffer"].to(device=dp.local.device, dtype=torch.float32)
                optimizer.state[p] = {"momentum_buffer": _tp.shard_of_full(full, dp).clone()}
            continue
        optimizer.state[p] = {
            k: (
                _local_like(v, p)
                if isinstance(v, torch.Tensor) and v.ndim > 0
                else (v.clone() if isinstance(v, torch.Tensor) else v)
            )
            for k, v in entry.items()
        }
