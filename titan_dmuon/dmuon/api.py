"""Entry points that hand Muon-target matrices to dedicated owners (call after TP, before fully_shard)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from . import costs
from . import ddp as _ddp
from . import replicate_axis as _replicate
from . import tp as _tp
from .comm import streams_for
from .group import DedicatedParamGroup
from .hooks import resolve_hook_modules
from .options import MuonOptions
from .param import DedicatedParam, local_of
from .partition import PartitionItem, compute_balanced_assignment
from .state import DMuonState, DPAxes, attach_state, find_state, state_of

Predicate = Callable[[str, nn.Parameter], bool]
Owner = int | tuple[int, int]
HeadBlocks = Mapping[str, tuple[int, int]]


def _check_mesh(mesh: DeviceMesh, what: str, expected_name: str | None) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{what} must be a 1D mesh, got {mesh.ndim}D with dims {mesh.mesh_dim_names}: pass the shard "
            "slice, e.g. dedicate_params(model, mesh['shard'], ..., replicate_mesh=mesh['replicate'])"
        )
    names = mesh.mesh_dim_names
    if expected_name is not None and names is not None and names[0] != expected_name:
        raise ValueError(
            f"{what} is named {names[0]!r} but HSDP needs mesh_dim_names ('replicate', 'shard'): build it "
            "with init_device_mesh(device, (R, G), mesh_dim_names=('replicate', 'shard'))"
        )


def _select(model: nn.Module, predicate: Predicate, allow_empty: bool = False) -> list[tuple[str, nn.Parameter]]:
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: FSDP2 already owns this model's params. "
            "Order: parallelize_module (TP) -> dmuon.dedicate_params -> fully_shard"
        )
    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        raise RuntimeError(
            "dedicate_params must be called before DistributedDataParallel wraps the model (DDP has already "
            "bucketed every param): dmuon.dedicate_params_ddp(model, mesh, predicate), then DDP(model)"
        )
    selected = []
    for name, p in model.named_parameters():
        if not predicate(name, p):
            continue
        if p.ndim not in (2, 3):
            raise ValueError(
                f"dedicate_params: the predicate selected '{name}' with shape {tuple(p.shape)}, but DMuon "
                "dedicates 2D matrices and 3D expert stacks (experts x out x in) only: add `p.ndim in (2, 3)` to "
                "the predicate"
            )
        if not p.requires_grad:
            continue
        selected.append((name, p))
    if not selected and not allow_empty:
        raise ValueError(
            "dedicate_params: the predicate selected no 2D/3D parameter that requires grad (allow_empty=True for a "
            "part of a model that has none, such as a pipeline stage)"
        )
    on_meta = sorted({p.device.type == "meta" for _, p in selected})
    if on_meta == [False, True]:
        meta = next(name for name, p in selected if p.device.type == "meta")
        raise ValueError(
            f"dedicate_params: '{meta}' is on the meta device but other selected params are not: dedicate a "
            "model that is all on meta (then dmuon.init_dedicated_params) or all materialized"
        )
    return selected


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    param_dtype: torch.dtype | None = None,
    tp_buffer_reuse: bool | str = False,
    reduce_dtype: torch.dtype = torch.float32,
    head_blocks: HeadBlocks | None = None,
    expert_mesh: DeviceMesh | None = None,
    allow_empty: bool = False,
) -> dict[nn.Parameter, Owner]:
    """Give every selected matrix one owner (global LPT) and install the broadcast/reduce hooks.

    `mesh` is the 1D shard mesh; `replicate_mesh` turns on HSDP (owners are `(shard, replicate)`
    coordinates over all G·R slots). `reshard_after_forward=True` is DMuon-Z3, False DMuon-Z2.
    Returns each dedicated param's owner: `int` (1D) or `(shard, replicate)` (HSDP).

    `reduce_dtype` (default fp32) is the dtype the Muon grads are reduced in: each rank casts its packed grads
    to it before the reduce, and the owner's momentum takes the fp32 result (FSDP2's `MixedPrecisionPolicy`
    reduce_dtype for the other params); bf16 halves the reduce bytes and rounds the average.

    `head_blocks` (per-head Muon, docs/dmuon.md "Per-head Muon") maps a dedicated matrix's FQN to `(dim, size)`:
    its Newton-Schulz runs on blocks of `size` along `dim` (0: row blocks, as wq/wk/wv's heads; 1: column blocks,
    as wo's input heads) once `dmuon.Muon(..., per_head=True)` uses them, and the LPT counts it as blocks ×
    the NS cost of one block. `size` must divide the matrix's (full) `dim`; a FQN that is not a dedicated matrix
    is a ValueError. Record only the blocks the optimizer will use (they set the partition's cost).

    A selected 3D parameter is an **expert stack** (experts x out x in, docs/dmuon.md "Experts"): Newton-Schulz
    runs on each expert's out x in matrix (batched), its lr scaled by that shape, as `torch.optim.Muon` would
    step each expert given as a 2D parameter. `expert_mesh` (expert parallelism) is the 1D mesh of the ranks that
    hold the same experts (the expert-data-parallel ranks; the stacks are DTensors sharded on dim 0 over the
    expert-parallel mesh): the stacks are then owned, broadcast and reduced over it (with `replicate_mesh`) instead
    of `mesh`, each behind its own module's hooks, and their grads scaled by `expert_mesh.size() / mesh.size()`
    (an expert-parallel rank's grad already sums every rank's tokens). Without it they are owned over `mesh`.

    On a model on the meta device it records the ownership and allocates nothing: then call
    `dmuon.init_dedicated_params(model, init_fn, device)` (after `fully_shard`) to allocate and fill each rank's
    share. On a materialized model each owner column copies its fp32 master from the live values.

    `allow_empty=True` accepts a predicate that selects nothing: the model (a pipeline stage of embeddings, norms
    and a head only) then has DMuon's state and no dedicated param, takes part in the collectives every rank runs
    (set-up, `clip_grad_norm_`'s, the state dicts') and `dmuon.Muon` steps its params with AdamW.
    """
    if find_state(model) is not None:
        raise RuntimeError("dedicate_params was already called on this model: call it once, for all params")
    _check_mesh(mesh, "mesh", "shard" if replicate_mesh is not None else None)
    if replicate_mesh is not None:
        _check_mesh(replicate_mesh, "replicate_mesh", "replicate")
    if expert_mesh is not None:
        _check_mesh(expert_mesh, "expert_mesh", None)
    if tp_buffer_reuse not in (False, True, "gather", "scatter", "all"):
        raise ValueError(f"tp_buffer_reuse must be False, True, 'gather', 'scatter' or 'all', got {tp_buffer_reuse!r}")
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise ValueError(f"reduce_dtype must be a floating torch.dtype (e.g. torch.float32), got {reduce_dtype!r}")
    selected = _select(model, predicate, allow_empty)
    return _dedicate(
        model,
        selected,
        mesh,
        replicate_mesh,
        reshard_after_forward=reshard_after_forward,
        hook_boundary_predicate=hook_boundary_predicate,
        param_dtype=param_dtype,
        mode="fsdp",
        tp_buffer_reuse=tp_buffer_reuse,
        reduce_dtype=reduce_dtype,
        head_blocks=head_blocks,
        expert_mesh=expert_mesh,
    )


def _dedicate(
    model,
    selected,
    mesh,
    replicate_mesh,
    *,
    reshard_after_forward,
    hook_boundary_predicate,
    param_dtype,
    mode,
    tp_buffer_reuse=False,
    reduce_dtype=torch.float32,
    head_blocks: HeadBlocks | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> dict[nn.Parameter, Owner]:
    blocks = _check_head_blocks(head_blocks, selected)
    own_axes = expert_mesh is not None
    experts = [(n, p) for n, p in selected if p.ndim == 3 and own_axes]
    dense = [(n, p) for n, p in selected if not (p.ndim == 3 and own_axes)]
    layouts, tp_rank = _layouts(dense, mesh, replicate_mesh)
    for name, p in dense:
        if p.ndim == 3 and layouts[name] is not None and layouts[name].shard_dim == 0:
            raise ValueError(
                f"dedicate_params: the expert stack '{name}' is split over its experts (dim 0) by expert "
                "parallelism: pass expert_mesh= (the ranks that hold the same experts), or its grads would be "
                "averaged with other experts' over the shard mesh"
            )
    state = DMuonState(
        shard_mesh=mesh,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=reshard_after_forward,
        mode=mode,
        tp_rank=tp_rank,
        tp_buffer_reuse=tp_buffer_reuse,
    )
    _check_coords(state.axes, "the shard (and replicate) slices")
    state.head_blocks = blocks
    hook_of = resolve_hook_modules(model, [n for n, _ in dense], hook_boundary_predicate)
    owned = _place(dense, state.axes, layouts, hook_of, blocks)
    if own_axes:  # expert stacks: their own axes, each behind its own module (a group has one set of axes)
        # built on every rank, stacks or not: it is collective (DPAxes gathers every rank's coordinates), and a
        # pipeline stage may hold no MoE layer (DeepSeek-V3's dense first layers) while the others do
        e_layouts, e_tp_rank = _layouts(experts, expert_mesh, replicate_mesh)
        state.expert_axes = DPAxes(
            expert_mesh,
            replicate_mesh,
            e_tp_rank,
            desc="dmuon_expert",
            grad_scale=expert_mesh.size() / state.axes.shard_size,
            replicate_group=state.axes.replicate_group,
        )
        _check_coords(state.expert_axes, "expert_mesh (and replicate_mesh)")
        hook_of.update(resolve_hook_modules(model, [n for n, _ in experts], lambda m: True))  # each stack's module
        owned += _place(experts, state.expert_axes, e_layouts, hook_of, blocks)

    by_module: dict[str, list[DedicatedParam]] = {}
    for name, p, dp in owned:
        local = local_of(p)
        if local.device.type == "meta":
            pass  # ownership only: init_dedicated_params allocates and fills the masters
        elif mode == "ddp" and local.dtype == torch.float32:
            dp._owned_data = local.data  # DDP keeps the live param: it is the fp32 master itself
        elif dp.in_owner_column:
            dp._owned_data = local.detach().to(torch.float32, copy=True)
        p._dedicated_owner_rank = dp.owner_rank
        p._dmuon_param = dp
        state.dparams.append(dp)
        state.by_param[p] = dp
        by_module.setdefault(hook_of[name], []).append(dp)

    module_order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    for fqn in sorted(by_module, key=lambda f: module_order[f]):
        dps = by_module[fqn]
        dtype = param_dtype or dps[0].local.dtype
        group = DedicatedParamGroup(
            state, len(state.groups), fqn, model.get_submodule(fqn), dps, dtype, dps[0].local.device, reduce_dtype
        )
        group.register_hooks()
        state.groups.append(group)
    attach_state(model, state)
    state.device = next((p.device for p in model.parameters()), state.device)
    if state.groups:
        state.streams = streams_for(state.groups[0].device)
    # The global owner's value is authoritative: make its column peers agree before the first forward (a meta
    # model has no values yet; init_dedicated_params fills every column rank alike).
    for g in state.groups:
        if not g.on_meta:
            g.after_step(_replicate.publish(g))
            g.wait_publish()  # DDP: a low-precision live param is refreshed from its owner's master here
    state.ledger.current.clear()
    state.ledger.current_bytes.clear()
    return {dp.param: dp.owner_rank for dp in state.dparams}


def _layouts(selected, mesh, replicate_mesh) -> tuple[dict[str, _tp.TPLayout | None], int]:
    """Each selected param's TP layout over the DP meshes `mesh` (shard) and `replicate_mesh`, and the coordinate
    that tells this rank's DP slice apart: the one the meshes' root gives (TP and pipeline-stage dims), else its
    TP-sharded params' rank, else 0."""
    dp_names = _tp.dp_mesh_names(mesh, replicate_mesh)
    layouts = {name: _tp.tp_layout(name, p, dp_names) for name, p in selected}
    ranks = {lay.rank for lay in layouts.values() if lay is not None}
    coordinate = _tp.tp_coordinate(mesh, replicate_mesh, dp_names)
    if coordinate is not None:
        return layouts, coordinate
    return layouts, next(iter(ranks)) if ranks else 0


def _check_coords(axes: DPAxes, what: str) -> None:
    if len(set(axes.coords)) != len(axes.coords) and dist.get_backend() != "fake":  # a fake PG gathers nothing
        raise ValueError(
            f"dedicate_params: two ranks have the same (shard, replicate, tp) coordinates on {what}, so owners "
            "cannot be told apart: pass the shard (and replicate) slices of one named DeviceMesh "
            "(init_device_mesh(..., mesh_dim_names=...)), whose other dims are the TP ones (coordinates by global "
            f"rank: {axes.coords})"
        )


def _place(selected, axes: DPAxes, layouts, hook_of, blocks) -> list[tuple[str, nn.Parameter, DedicatedParam]]:
    """One DedicatedParam per selected matrix, owned over `axes`: global LPT over its G·R owner slots (an expert
    stack costs its experts' NS, `partition.item_cost`), TP owners inside each DP owner's bucket."""
    G, R = axes.shard_size, axes.replicate_size
    items = [
        PartitionItem(n, tuple(p.shape), hook_of[n], mergeable=layouts[n] is None, head_blocks=blocks.get(n))
        for n, p in selected
    ]
    slots = compute_balanced_assignment(items, G * R)
    tp_owner = _assign_tp_owners(items, slots, layouts)
    out = []
    for name, p in selected:
        slot, lay = slots[name], layouts[name]
        dp = DedicatedParam(
            fqn=name,
            param=p,
            owner_shard=slot % G,
            owner_replicate=slot // G,
            shard_rank=axes.shard_rank,
            replicate_rank=axes.replicate_rank,
            full_shape=p.shape,
            axes=axes,
            _orig_size=local_of(p).shape,
        )
        if lay is not None:
            dp.shard_dim, dp.tp_group, dp.tp_rank, dp.tp_owner = lay.shard_dim, lay.group, lay.rank, tp_owner[name]
        out.append((name, p, dp))
    return out


def _check_head_blocks(head_blocks: HeadBlocks | None, selected) -> dict[str, tuple[int, int]]:
    """`head_blocks` checked against the selected matrices: each key a dedicated FQN, each value `(dim, size)` with
    dim 0 or 1 and `size` dividing the matrix's (full) `dim`. Returns a plain dict of int pairs."""
    if not head_blocks:
        return {}
    shapes = {name: tuple(p.shape) for name, p in selected}
    out: dict[str, tuple[int, int]] = {}
    for fqn, spec in head_blocks.items():
        if fqn not in shapes:
            raise ValueError(
                f"head_blocks names '{fqn}', which is not a dedicated matrix (one the predicate selects, 2D, requiring "
                "grad): give head blocks for dedicated matrices only"
            )
        try:
            dim, size = spec
        except (TypeError, ValueError):
            raise ValueError(f"head_blocks['{fqn}'] must be a pair (dim, size), got {spec!r}") from None
        if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1):
            raise ValueError(f"head_blocks['{fqn}'] = {spec!r}: dim must be 0 (row blocks) or 1 (column blocks)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or shapes[fqn][dim] % size:
            raise ValueError(
                f"head_blocks['{fqn}'] = {spec!r}: the block size must be a positive integer dividing dim {dim} of the "
                f"matrix, which has {shapes[fqn][dim]} entries (shape {shapes[fqn]})"
            )
        out[fqn] = (int(dim), int(size))
    return out


def _assign_tp_owners(
    items: list[PartitionItem], slots: dict[str, int], layouts: dict[str, _tp.TPLayout | None]
) -> dict[str, int]:
    """TP owner of each TP-sharded param: LPT over the TP ranks inside each DP owner's bucket, so the
    full-matrix NS work of one DP owner spreads over its TP group."""
    buckets: dict[int, list[PartitionItem]] = {}
    for it in items:
        if layouts[it.name] is not None:
            buckets.setdefault(slots[it.name], []).append(it)
    owners: dict[str, int] = {}
    for slot in sorted(buckets):
        bucket = buckets[slot]
        owners.update(compute_balanced_assignment(bucket, layouts[bucket[0].name].size, small_param_threshold=0))
    return owners


def dedicate_params_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    head_blocks: HeadBlocks | None = None,
) -> dict[nn.Parameter, int]:
    """DDP path (docs/dmuon.md, "DDP"): every rank keeps the live full param; each grad is averaged onto
    its owner, only the owner runs NS, and after the step the owner broadcasts the updated param.

    For the other params, either `replicate(model, mesh)` or torch's `DistributedDataParallel(model)`: the
    dedicated params are marked for DDP to ignore. `head_blocks` as in `dedicate_params` (per-head Muon).
    Returns each dedicated param's owner rank in `mesh`.
    """
    return _dedicate_ddp(
        "dedicate_params_ddp",
        model,
        mesh,
        predicate,
        allow_tp=False,
        hook_boundary_predicate=hook_boundary_predicate,
        tp_buffer_reuse=False,
        head_blocks=head_blocks,
    )


def dedicate_params_ddp_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    tp_buffer_reuse: bool | str = False,
    head_blocks: HeadBlocks | None = None,
) -> dict[nn.Parameter, int]:
    """DDP + TP (docs/dmuon.md, "Tensor parallelism"): like `dedicate_params_ddp`, with TP-sharded matrices
    handled by the TP gather -> full-matrix NS on the TP owner -> scatter path. Call after
    `parallelize_module`, with the DP slice. `head_blocks` as in `dedicate_params` (per-head Muon)."""
    return _dedicate_ddp(
        "dedicate_params_ddp_tp",
        model,
        mesh,
        predicate,
        allow_tp=True,
        hook_boundary_predicate=hook_boundary_predicate,
        tp_buffer_reuse=tp_buffer_reuse,
        head_blocks=head_blocks,
    )


def _dedicate_ddp(
    what: str,
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    allow_tp: bool,
    hook_boundary_predicate,
    tp_buffer_reuse,
    head_blocks=None,
) -> dict[nn.Parameter, int]:
    """The DDP paths: DMuon's replicate axis is the whole DP mesh (no shard axis); owners as mesh ranks."""
    if find_state(model) is not None:
        raise RuntimeError(f"{what}: DMuon was already applied to this model: call it once")
    _check_mesh(mesh, "mesh", None)
    selected = _select(model, predicate)
    if not allow_tp:
        dp_names = _tp.dp_mesh_names(None, mesh)
        for name, p in selected:
            if _tp.tp_layout(name, p, dp_names) is not None:
                raise ValueError(
                    f"{what}: '{name}' is sharded by tensor parallelism; use "
                    "dmuon.dedicate_params_ddp_tp(model, mesh['dp'], predicate) and dmuon.replicate_tp for TP "
                    "models"
                )
    owners = _dedicate(
        model,
        selected,
        None,
        mesh,
        reshard_after_forward=False,
        hook_boundary_predicate=hook_boundary_predicate,
        param_dtype=None,
        mode="ddp",
        tp_buffer_reuse=tp_buffer_reuse,
        head_blocks=head_blocks,
    )
    _ddp.ignore_in_torch_ddp(model, [name for name, _ in selected])
    return {p: o[1] if isinstance(o, tuple) else o for p, o in owners.items()}


def replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP for every param DMuon does not own: same start on every rank, grads averaged after backward.

    An alternative to wrapping the model in torch's DistributedDataParallel (use one or the other). A model
    with DTensor (tensor-parallel) params goes through `replicate_tp`, which checks the mesh against them.
    """
    _check_mesh(mesh, "mesh", None)
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(
                f"replicate: '{name}' is a DTensor (tensor parallelism): use dmuon.replicate_tp(model, mesh['dp']), "
                "which checks that the mesh is the DP slice of its TP mesh"
            )
    return _replicate_rest(model, mesh)


def replicate_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP + TP for every param DMuon does not own (docs/dmuon.md, "Tensor parallelism"): each rank's
    TP-local shard is replicated along `mesh`, which must be the DP slice (`mesh["dp"]` of a (dp, tp) mesh).

    The gradient all-reduce averages local shards, so it is right only among ranks that hold the same shard:
    `mesh` must be named (TP dims are told from DP dims by name), no DTensor param may live on a mesh with
    `mesh`'s dim, and `mesh` must meet each DTensor's mesh in this rank alone (a 1D world mesh would average
    different TP shards together). A partial (TP-reduced) grad is redistributed to its param's placements
    before the all-reduce.
    """
    _check_mesh(mesh, "mesh", None)
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "replicate_tp: the DP mesh has no dim name: build the mesh with mesh_dim_names (e.g. "
            "init_device_mesh(dev, (dp, tp), mesh_dim_names=('dp', 'tp'))) and pass mesh['dp']"
        )
    dp_name, me = mesh.mesh_dim_names[0], dist.get_rank()
    dp_ranks = set(mesh.mesh.flatten().tolist())
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        tp_mesh = p.device_mesh
        if dp_name in (tp_mesh.mesh_dim_names or ()):
            raise ValueError(
                f"replicate_tp: '{name}' is a DTensor on a mesh with the DP dim {dp_name!r} "
                f"{tp_mesh.mesh_dim_names}: replicate_tp replicates TP-local shards along the DP mesh, so the "
                "params must be TP-parallelized on the TP slice (parallelize_module(model, mesh['tp'], plan))"
            )
        shared = dp_ranks & set(tp_mesh.mesh.flatten().tolist())
        if shared != {me}:
            raise ValueError(
                f"replicate_tp: the mesh {mesh.mesh_dim_names} is not the DP slice for '{name}': it shares ranks "
                f"{sorted(shared)} with that param's TP mesh {tp_mesh.mesh_dim_names}, so different TP shards "
                "would be averaged together: pass mesh['dp'] of the (dp, tp) mesh"
            )
    return _replicate_rest(model, mesh)


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """`replicate`'s and `replicate_tp`'s body: every trainable param DMuon does not own, replicated on `mesh`."""
    state = find_state(model)
    dedicated = state.by_param if state is not None else {}
    params = [p for p in model.parameters() if p.requires_grad and p not in dedicated]
    _ddp.replicate_params(model, params, mesh.get_group())
    return model


def get_dedicated_params(model: nn.Module) -> list[DedicatedParam]:
    """Every dedicated param in group (forward) order, with its owner coordinates (`owner_shard`,
    `owner_replicate`, `tp_owner`), shapes and group: the plan every rank computes alike (no communication)."""
    state = state_of(model, "get_dedicated_params")
    return [dp for g in state.groups for dp in g.params]


def get_owned_params(model: nn.Module, rank: int | None = None) -> list[DedicatedParam]:
    """The dedicated params whose global owner is `rank` (default: this process's global rank)."""
    state = state_of(model, "get_owned_params")
    rank = dist.get_rank() if rank is None else rank
    return [dp for dp in state.dparams if dp.axes.owner_global_rank(dp, dp.axes.coords[rank][2]) == rank]


def dedicated_matrices(model: nn.Module, options: MuonOptions | None = None) -> list[costs.Matrix]:
    """The model's dedicated matrices as the cost model's plain records (titan_dmuon/dmuon/costs.py), in group
    (forward) order, [] before `dedicate_params`: what a planner sums the cost functions over. `options` (default:
    MuonOptions()) decide the active head blocks (per_head, per_head_wo), as in dmuon.Muon."""
    state = find_state(model)
    if state is None:
        return []
    options = MuonOptions() if options is None else options
    out = []
    for group in state.groups:
        for dp in group.params:
            full = tuple(int(d) for d in dp.full_shape)
            out.append(
                costs.Matrix(
                    fqn=dp.fqn,
                    full_shape=full,
                    local_shape=tuple(int(d) for d in dp._orig_size),
                    owner_shard=dp.owner_shard,
                    owner_replicate=dp.owner_replicate,
                    shard_dim=dp.shard_dim if dp.tp_group is not None else None,
                    tp_owner=dp.tp_owner,
                    head_blocks=costs.update_blocks(full, options.active_blocks(state.head_blocks.get(dp.fqn))),
                    expert=state.expert_axes is not None and dp.axes is state.expert_axes,
                    group=group.index,
                    hook=group.module_fqn,
                    param_itemsize=group.dtype.itemsize,
                    reduce_itemsize=group.reduce_dtype.itemsize,
                )
            )
    return out


def tp_paths(model: nn.Module, optimizer) -> list[tuple[costs.Matrix, costs.TPDecision]]:
    """Each TP-sharded dense dedicated matrix (an expert stack's EP shard holds whole experts: no TP path) with the
    path `optimizer` (a dmuon.Muon) takes for it and why: `costs.tp_decision` under its `tp_distributed_gram`,
    `tp_distributed_gram_policy` and NS settings, the one rule the optimizer and the planner follow. Plain values,
    the same on every rank; [] without TP."""
    options = optimizer.options
    gram = (optimizer.tp_distributed_gram, optimizer.tp_distributed_gram_policy, _tp.gram_restarts_of(options))
    return [(m, m.tp_decision(*gram)) for m in dedicated_matrices(model, options) if m.shard_dim is not None]


def describe_tp_paths(model: nn.Module, optimizer) -> str:
    """`tp_paths` as the start-up log prints it: a header (the settings, how many matrices take each path), then one
    line per matrix, the matrices that differ only in their block index (`layers.N`) on one line: shape, TP-split
    dim, path, why and, where the Gram path is possible, both paths' fp32 bytes per TP rank of the DP owner and
    step. "" without TP."""
    decided = tp_paths(model, optimizer)
    if not decided:
        return ""
    segments = 1 + len(_tp.gram_restarts_of(optimizer.options))
    count: dict[str, int] = {}
    for _, d in decided:
        count[d.path] = count.get(d.path, 0) + 1
    lines = [
        f"DMuon TP paths (tp_distributed_gram={optimizer.tp_distributed_gram}, "
        f"tp_distributed_gram_policy={optimizer.tp_distributed_gram_policy!r}, {segments} Gram all-reduces per NS): "
        + ", ".join(f"{path} {n}" for path, n in sorted(count.items()))
    ]
    rows: dict[str, list[str]] = {}
    for m, d in decided:
        pattern = ".".join("*" if part.isdigit() else part for part in m.fqn.split("."))
        shape = "x".join(str(s) for s in m.full_shape)
        line = f"{pattern} {shape}, TP {m.tp_size} on dim {m.shard_dim}: {d.path} ({d.reason}"
        if d.gram_bytes and d.gather_bytes:
            line += f"; per TP rank: Gram {_mib(d.gram_bytes)}, gather+scatter {_mib(d.gather_bytes)}"
        line += ")"
        rows.setdefault(line, []).append(m.fqn)
    for line, fqns in rows.items():
        lines.append(f"  {line}" if len(fqns) == 1 else f"  {line} [x{len(fqns)}]")
    return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"
