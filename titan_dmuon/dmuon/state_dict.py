"""DMuon's model and optimizer state dicts, keyed by FQN (keys as a plain `model.state_dict()`).

Two kinds (docs/dmuon.md, "Checkpoints"):

- Sharded (`full_state_dict=False`): what `torch.distributed.checkpoint` (DCP) saves and loads. Each
  rank holds only its share, aliasing live storage: a dedicated matrix's fp32 master on the ranks that keep
  it (its owner's shard column), its momentum on its global owner, a TP-sharded one as a DTensor over its TP
  mesh, FSDP2/TP params and their AdamW moments as DTensors. DCP writes each key once (its planner
  de-duplicates identical keys) and, on load, each rank's dict asks for what that rank holds under the NEW
  ownership: any topology loads any other, and no rank reads more than its share plus whole matrices it owns.
  Nothing is gathered.
- Full (`full_state_dict=True`, the default): full tensors, for a single-file checkpoint or a look at the
  weights. Getters assemble each full tensor from its holders (one at a time), on every rank or on rank 0 only
  (`rank0_only`), optionally moved to CPU (`cpu_offload`); setters take the same full dicts (CPU tensors
  too; rank 0's alone with `broadcast_from_rank0`) and keep only what each rank holds.

Both drain pending async publishes first (a publish writes into the column peers' masters). The option mirrors
torch's `StateDictOptions(full_state_dict=...)`; `rank0_only`, `cpu_offload` and `broadcast_from_rank0` apply to
full dicts only (`_full_only`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from . import tp as _tp
from .muon import init_adamw_state
from .param import DedicatedParam, local_of
from .state import DMuonState, state_of, unwrap


def _comm_device(state: DMuonState) -> torch.device:
    """The device DMuon's collectives run on: its params' (CUDA under NCCL, where a CPU tensor would fail)."""
    return state.groups[0].device if state.groups else state.device


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full copy of `t` (a DTensor on a 1-rank mesh returns its local tensor from `full_tensor()`: copied too)."""
    t = t.detach()
    if not isinstance(t, DTensor):
        return t.clone()
    full = t.full_tensor()
    return full.clone() if full.untyped_storage().data_ptr() == t._local_tensor.untyped_storage().data_ptr() else full


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
    ax = dp.axes
    if not on_column and ax.replicate_group is not None and dp.in_owner_column:
        dist.broadcast(out, src=ax.replicate_global_rank(dp.owner_replicate), group=ax.replicate_group)
    if ax.shard_group is not None:
        dist.broadcast(out, src=ax.shard_global_rank(dp.owner_shard), group=ax.shard_group)
    return _tp.full_from_shards(out, dp)


def _local_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        full = full.detach().to(dtype=like.dtype, device=like.device)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.detach().to(dtype=like.dtype, device=like.device)


class _Emit:
    """Where a full getter's tensors go: kept on every rank or on rank 0 only, on their device or on CPU."""

    def __init__(self, rank0_only: bool, cpu_offload: bool):
        self.keep = not rank0_only or dist.get_rank() == 0
        self.cpu_offload = cpu_offload

    def __call__(self, value: Any) -> Any:
        if self.cpu_offload and isinstance(value, torch.Tensor):
            return value.cpu()
        return value


def get_model_state_dict(
    model: nn.Module, *, full_state_dict: bool = True, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, Any]:
    """Full fp32 weights by FQN on every rank (`rank0_only`: on rank 0, `{}` elsewhere; `cpu_offload`: as CPU
    tensors, moved one at a time). Every rank must call it (it runs collectives).

    `full_state_dict=False`: this rank's share for DCP, aliasing live storage (`_get_sharded_model_state_dict`)."""
    if not full_state_dict:
        _full_only("get_model_state_dict", rank0_only=rank0_only, cpu_offload=cpu_offload)
        return _get_sharded_model_state_dict(model)
    state = state_of(model, "get_model_state_dict")
    model = unwrap(model)
    state.drain_publish()
    emit = _Emit(rank0_only, cpu_offload)
    out: dict[str, torch.Tensor] = {}
    for fqn, t in model.state_dict(keep_vars=True).items():
        dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
        full = _owner_tensor(state, dp, dp._owned_data, on_column=True) if dp is not None else _full(t)
        if emit.keep:
            out[fqn] = emit(full)
    return out


def set_model_state_dict(
    model: nn.Module, sd: dict[str, Any], *, full_state_dict: bool = True, broadcast_from_rank0: bool = False
) -> None:
    """Load full weights (as `get_model_state_dict` returns them, on any device) on every rank.

    `broadcast_from_rank0`: only rank 0's `sd` is read (pass `{}` elsewhere, e.g. what a `rank0_only` getter
    returned); each tensor is broadcast in turn and every rank keeps its share, one full tensor at a time.
    `full_state_dict=False`: `sd` is a sharded dict that `dcp.load` filled (`_set_sharded_model_state_dict`)."""
    if not full_state_dict:
        _full_only("set_model_state_dict", broadcast_from_rank0=broadcast_from_rank0)
        _set_sharded_model_state_dict(model, sd)
        return
    state = state_of(model, "set_model_state_dict")
    model = unwrap(model)
    state.drain_publish()
    state.reshard_all()
    current = model.state_dict(keep_vars=True)
    if broadcast_from_rank0:
        spec = _rank0_spec(state, sd)
        _check_keys("set_model_state_dict", set(current), set(spec))
        entries = _stream_from_rank0(state, sd, spec)
    else:
        _check_keys("set_model_state_dict", set(current), set(sd))
        entries = ((fqn, sd[fqn]) for fqn in current)
    with torch.no_grad():
        for fqn, full in entries:
            t = current[fqn]
            if tuple(full.shape) != tuple(t.shape):
                raise ValueError(
                    f"set_model_state_dict: '{fqn}' has shape {tuple(full.shape)}, the model "
                    f"expects {tuple(t.shape)} (a checkpoint from another model config?)"
                )
            dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
            if dp is not None:
                if dp.in_owner_column:
                    dp._owned_data.copy_(_tp.shard_of_full(full.to(dp._owned_data.device), dp))
                _refresh_live(dp)
            elif isinstance(t, DTensor):
                t.to_local().copy_(_local_like(full, t).to_local())
            else:
                t.copy_(full)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    full_state_dict: bool = True,
    rank0_only: bool = False,
    cpu_offload: bool = False,
) -> dict[str, Any]:
    """Full optimizer state `{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}` on every
    rank (`rank0_only`: on rank 0, `{}` elsewhere; `cpu_offload`: CPU tensors). Every rank must call it.

    `full_state_dict=False`: this rank's share for DCP, aliasing live state (`_get_sharded_optimizer_state_dict`)."""
    if not full_state_dict:
        _full_only("get_optimizer_state_dict", rank0_only=rank0_only, cpu_offload=cpu_offload)
        return _get_sharded_optimizer_state_dict(model, optimizer)
    state = state_of(model, "get_optimizer_state_dict")
    model = unwrap(model)
    state.drain_publish()
    emit = _Emit(rank0_only, cpu_offload)
    names = {p: n for n, p in model.named_parameters()}
    # which dedicated params have a momentum buffer yet (it lives on the owners only): one all-reduce, on the
    # device DMuon's collectives use
    has = torch.tensor(
        [int(dp.is_owner and "momentum_buffer" in optimizer.state.get(dp.param, {})) for dp in state.dparams],
        dtype=torch.int64,
        device=_comm_device(state),
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
                    buf = _momentum_shard(dp, optimizer) if dp.is_owner else None
                    full = _owner_tensor(state, dp, buf, on_column=False)
                    if emit.keep:
                        out_state[fqn] = {"momentum_buffer": emit(full)}
            elif optimizer.state.get(p):
                entry = {
                    k: _full(v)
                    if isinstance(v, torch.Tensor) and v.ndim > 0
                    else (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in optimizer.state[p].items()
                }
                if emit.keep:
                    out_state[fqn] = {k: emit(v) for k, v in entry.items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    if not emit.keep:
        return {}
    return {"state": out_state, "param_groups": groups}


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sd: dict[str, Any],
    *,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a full optimizer state (as `get_optimizer_state_dict` returns it, on any device) on every rank.

    `broadcast_from_rank0`: only rank 0's `sd` is read (`{}` elsewhere); each param's state is broadcast in turn
    and every rank keeps its share. `full_state_dict=False`: `sd` is a sharded dict that `dcp.load` filled
    (`_set_sharded_optimizer_state_dict`)."""
    if not full_state_dict:
        _full_only("set_optimizer_state_dict", broadcast_from_rank0=broadcast_from_rank0)
        _set_sharded_optimizer_state_dict(model, optimizer, sd)
        return
    state = state_of(model, "set_optimizer_state_dict")
    model = unwrap(model)
    state.drain_publish()
    params = dict(model.named_parameters())
    if broadcast_from_rank0:
        flat = {(fqn, key): v for fqn, entry in sd.get("state", {}).items() for key, v in entry.items()}
        spec = _rank0_spec(state, {"param_groups": sd.get("param_groups"), **flat})
        groups = spec.pop("param_groups")[1]
        entries = _group_by_param(_stream_from_rank0(state, flat, spec))
    else:
        groups, entries = sd["param_groups"], iter(sd["state"].items())
    _load_param_groups("set_optimizer_state_dict", params, optimizer, groups)
    optimizer.state.clear()
    for fqn, entry in entries:
        if fqn not in params:
            raise KeyError(f"set_optimizer_state_dict: the checkpoint has state for '{fqn}', which the model lacks")
        p = params[fqn]
        dp = state.by_param.get(p)
        if dp is not None:
            if dp.is_owner:
                full = entry["momentum_buffer"].to(device=dp.local.device, dtype=torch.float32)
                if not dp.tp_full_momentum:
                    optimizer.state[p] = {"momentum_buffer": _tp.shard_of_full(full, dp).clone()}
                elif dp.is_tp_owner:  # kept whole on its TP owner (tp_gather="backward")
                    optimizer.state[p] = {"momentum_buffer": full.clone()}
            continue
        optimizer.state[p] = {
            k: (
                _local_like(v, p)
                if isinstance(v, torch.Tensor) and v.ndim > 0
                else (v.clone() if isinstance(v, torch.Tensor) else v)
            )
            for k, v in entry.items()
        }


def _rank0_spec(state: DMuonState, sd: dict) -> dict:
    """Rank 0's `sd` described for every rank (key -> ("tensor", shape, dtype) or ("value", value)), in its order:
    one object broadcast, so that every rank checks the same keys and expects the same tensors."""
    spec = None
    if dist.get_rank() == 0:
        spec = {
            k: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v)
            for k, v in sd.items()
        }
    box = [spec]
    dist.broadcast_object_list(box, src=0, device=_comm_device(state))
    return box[0]


def _stream_from_rank0(state: DMuonState, sd: dict, spec: dict):
    """(key, value) for each entry of `spec`, each tensor broadcast from rank 0 when asked for (one at a time)."""
    device = _comm_device(state)
    for key, (kind, *rest) in spec.items():
        if kind == "value":
            yield key, rest[0]
            continue
        shape, dtype = rest
        if dist.get_rank() == 0:
            buf = sd[key].detach().to(device=device, dtype=dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=0)
        yield key, buf


def _group_by_param(items):
    """((fqn, key), value) pairs, grouped by fqn in order -> (fqn, {key: value}), one param's entry at a time."""
    entry_fqn, entry = None, {}
    for (fqn, key), value in items:
        if fqn != entry_fqn and entry:
            yield entry_fqn, entry
            entry = {}
        entry_fqn, entry[key] = fqn, value
    if entry:
        yield entry_fqn, entry


# ---- sharded (DCP) state: full_state_dict=False -------------------------------------------------------------
_SHARDED = "(full_state_dict=False)"


def _full_only(what: str, **options: bool) -> None:
    """Refuse the full-dict options with a sharded dict: it is every rank's own share aliasing live storage, which
    rank 0 alone cannot hold, a CPU copy would stop `dcp.load` writing in place, and DCP stages to CPU itself
    (`dcp.async_save`)."""
    given = [name for name, value in options.items() if value]
    if given:
        raise ValueError(
            f"{what}{_SHARDED}: {', '.join(given)} applies to full state dicts only (a sharded dict is each "
            "rank's own share, aliasing live storage): drop it, or pass full_state_dict=True"
        )


def _get_sharded_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's share of the weights, by FQN, aliasing live storage (no collective, nothing gathered).

    A dedicated matrix is its fp32 master, present only on the ranks that keep one (its owner's shard column:
    under HSDP one rank per replicate row, under DDP every rank; DCP writes it once), as a DTensor over its TP
    mesh when TP shards it; FSDP2/TP params are their sharded DTensors; the rest (DDP-replicated params,
    buffers) plain tensors on every rank."""
    state = state_of(model, f"get_model_state_dict{_SHARDED}")
    module = unwrap(model)
    state.drain_publish()
    out: dict[str, torch.Tensor] = {}
    for fqn, t in module.state_dict(keep_vars=True).items():
        dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
        if dp is None:
            out[fqn] = t.detach()
        elif dp.in_owner_column:
            out[fqn] = _tp_view(dp, dp._owned_data)
    return out


def _set_sharded_model_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """After `dcp.load` filled `_get_sharded_model_state_dict`'s dict (or any dict of that layout): copy what
    does not alias live storage, refresh the derived copies (DDP's live params; the packed buffers are
    re-filled from the masters at the next forward)."""
    state = state_of(model, f"set_model_state_dict{_SHARDED}")
    module = unwrap(model)
    state.drain_publish()
    state.reshard_all()
    current = module.state_dict(keep_vars=True)
    held = {
        fqn
        for fqn, t in current.items()
        if not (isinstance(t, nn.Parameter) and t in state.by_param and not state.by_param[t].in_owner_column)
    }
    _check_keys(f"set_model_state_dict{_SHARDED}", held, set(sd))
    with torch.no_grad():
        for fqn, t in current.items():
            dp = state.by_param.get(t) if isinstance(t, nn.Parameter) else None
            if dp is not None:
                if dp.in_owner_column:
                    _copy_local(dp._owned_data, sd[fqn], fqn)
                _refresh_live(dp)
            else:
                _copy_local(local_of(t), sd[fqn], fqn)


def _get_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's share of `optimizer`'s state, by param FQN, aliasing the live state; a TP matrix whose momentum is
    kept whole on its TP owner gives each DP owner a copy of its TP shard (a scatter over the TP group: every rank
    calls this at the same point).

    `{"state": {fqn: {...}}, "param_groups": [{kind, lr, ..., "params": [fqn, ...]}, ...]}`: a dedicated
    matrix's `momentum_buffer` only on its global owner (a DTensor over its TP mesh when TP shards it); AdamW's
    `step`, `exp_avg`, `exp_avg_sq` of every other param (DTensors for FSDP2/TP params) on every rank that holds
    the param. State the optimizer would create lazily at its first step is created now (zeros), so the dict
    of a fresh optimizer is a complete load template."""
    state = state_of(model, f"get_optimizer_state_dict{_SHARDED}")
    module = unwrap(model)
    state.drain_publish()
    _init_optimizer_state(state, optimizer)
    names = {p: n for n, p in module.named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            dp = state.by_param.get(p)
            if dp is None:
                out[names[p]] = dict(optimizer.state[p])
            elif dp.is_owner:
                out[names[p]] = {"momentum_buffer": _tp_view(dp, _momentum_shard(dp, optimizer))}
    return {"state": out, "param_groups": _param_groups(names, optimizer)}


def _momentum_shard(dp: DedicatedParam, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """On a matrix's DP owner: its (TP-local) momentum buffer, the live one (aliased by a sharded state dict), or a
    copy of its TP shard where the momentum is kept whole on the TP owner (a TP-group collective: every DP owner of
    the matrix calls it at the same point). A checkpoint holds the same logical tensor either way."""
    buf = optimizer.state.get(dp.param, {}).get("momentum_buffer")
    return _tp.momentum_shard(dp, buf)


def _set_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """After `dcp.load` filled `_get_sharded_optimizer_state_dict`'s dict (or any dict of that layout): the
    hyper-parameters of each param group, and every state tensor that does not alias the live one."""
    state = state_of(model, f"set_optimizer_state_dict{_SHARDED}")
    module = unwrap(model)
    state.drain_publish()
    params = dict(module.named_parameters())
    _load_param_groups(f"set_optimizer_state_dict{_SHARDED}", params, optimizer, sd["param_groups"])
    _init_optimizer_state(state, optimizer)
    fqn_of = {p: n for n, p in params.items()}
    whole = {fqn_of[dp.param]: dp for dp in state.dparams if dp.is_owner and dp.tp_full_momentum}
    held = {
        n
        for n, p in params.items()
        if (p in optimizer.state and (p not in state.by_param or state.by_param[p].is_owner)) or n in whole
    }
    _check_keys(f"set_optimizer_state_dict{_SHARDED}", held, set(sd["state"]), "param states")
    with torch.no_grad():
        for fqn, dp in whole.items():  # in the matrices' order, the same on every rank: each is a TP-group gather
            saved = sd["state"][fqn]
            _check_keys(f"set_optimizer_state_dict{_SHARDED}: '{fqn}'", {"momentum_buffer"}, set(saved), "state")
            shard = local_of(saved["momentum_buffer"]).to(dp._owned_data.device, torch.float32)
            home = _tp.momentum_home(dp, shard)
            if home is not None:
                optimizer.state[dp.param]["momentum_buffer"].copy_(home)
        for fqn in held - set(whole):
            live = optimizer.state[params[fqn]]
            saved = sd["state"][fqn]
            _check_keys(f"set_optimizer_state_dict{_SHARDED}: '{fqn}'", set(live), set(saved), "state")
            for key, value in saved.items():
                _copy_local(local_of(live[key]), value, f"{fqn}.{key}")


def _tp_view(dp: DedicatedParam, local: torch.Tensor) -> torch.Tensor:
    """`local` (a TP-local tensor of `dp`'s shape) as a DTensor laid out like the param over its TP mesh, sharing
    storage; `local` itself when `dp` is not TP-sharded."""
    if dp.tp_group is None:
        return local
    p = dp.param
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _copy_local(live: torch.Tensor, value: Any, name: str) -> None:
    """Copy a loaded value into the live (plain, local) tensor, unless it already is that storage."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}': expected a tensor, got {type(value).__name__}")
    src = local_of(value)
    if tuple(src.shape) != tuple(live.shape):
        raise ValueError(f"'{name}': the loaded local shard has shape {tuple(src.shape)}, expected {tuple(live.shape)}")
    if src.data_ptr() != live.data_ptr() or src.device != live.device:
        live.copy_(src)


def _refresh_live(dp: DedicatedParam) -> None:
    """DDP keeps a live param beside a non-fp32 master: refresh it from the master."""
    if dp.group.live and dp._owned_data.data_ptr() != dp.local.data_ptr():
        dp.local.data.copy_(dp._owned_data)


def _init_optimizer_state(state: DMuonState, optimizer: torch.optim.Optimizer) -> None:
    """Create the state `dmuon.Muon.step` would create lazily: a zero momentum on each dedicated matrix's
    owner, AdamW's zero moments and step 0 on every other param."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            dp = state.by_param.get(p)
            if dp is None:
                if not optimizer.state.get(p):
                    init_adamw_state(p, optimizer.state[p])
            elif dp.is_owner and "momentum_buffer" not in optimizer.state.get(p, {}):
                if not dp.tp_full_momentum:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(dp._owned_data)
                elif dp.is_tp_owner:  # kept whole on the TP owner
                    optimizer.state[p]["momentum_buffer"] = dp._owned_data.new_zeros(dp.full_shape)


def _param_groups(names: dict[nn.Parameter, str], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters (its `kind` included) and its params' FQNs, in group order."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def _load_param_groups(what: str, params: dict[str, nn.Parameter], optimizer, saved_groups: list[dict]) -> None:
    """Take the saved hyper-parameters, group by group, after checking the groups hold the same params."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{what}: the checkpoint has {len(saved_groups)} param groups, the optimizer {len(optimizer.param_groups)}"
        )
    names = {p: n for n, p in params.items()}
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        mine = sorted(names[p] for p in group["params"])
        if mine != sorted(saved["params"]):
            diff = sorted(set(mine) ^ set(saved["params"]))
            raise ValueError(
                f"{what}: param group {i} ({group.get('kind')}) differs from the checkpoint's in {diff[:5]} "
                "(another model or optimizer.muon_params?)"
            )
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _check_keys(where: str, expected: set[str], got: set[str], noun: str = "keys") -> None:
    """A KeyError naming what `got` lacks or has beyond `expected`."""
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise KeyError(f"{where}: missing {noun} {missing[:5]}, unexpected {noun} {unexpected[:5]}")
