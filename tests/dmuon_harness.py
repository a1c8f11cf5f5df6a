"""One training harness for the DMuon distributed tests: builds the model on a 1D FSDP2, HSDP or DDP
layout, trains it, and checks the invariants I1-I4 (seed 001 §8) on every rank as it goes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.reference import fp32_torch_muon, reference_optimizers
from tests.tiny_models import TinyMLP, batch, proj_predicate

D, FF, LAYERS, B = 32, 64, 4, 4  # 4 layers = 4 merged owner units: every slot of 4 ranks owns one
HP = dict(
    lr=0.02,
    momentum=0.95,
    weight_decay=0.1,
    adamw_lr=1e-3,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    adamw_weight_decay=0.01,
)


def reference(world_size: int, steps: int):
    """Single process, the ranks' batches concatenated: torch.optim.Muon (fp32 NS) + AdamW."""
    torch.manual_seed(0)
    model = TinyMLP(D, FF, LAYERS)
    muon, adamw = reference_optimizers(model, proj_predicate, **HP)
    losses = []
    with fp32_torch_muon():
        for step in range(steps):
            loss = model(torch.cat([batch(step, r, B, D) for r in range(world_size)]))
            loss.backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(layout: str, mesh_shape: tuple[int, ...], *, z3: bool = True, replicate_async: bool = True):
    """layout: "fsdp" (1D), "hsdp" ((R, G) mesh), "ddp" (dedicate_params_ddp + replicate)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    model = TinyMLP(D, FF, LAYERS)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", mesh_shape)
        owners = dmuon.dedicate_params(model, mesh, proj_predicate, reshard_after_forward=z3)
        fsdp_mesh = mesh
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        owners = dmuon.dedicate_params(
            model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], reshard_after_forward=z3
        )
        fsdp_mesh = mesh
    elif layout == "ddp":
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp",))
        owners = dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        dmuon.replicate(model, mesh)
        fsdp_mesh = None
    else:
        raise ValueError(layout)
    if fsdp_mesh is not None:
        shard_blocks(model, fsdp_mesh)
    return model, build_muon(model, replicate_async=replicate_async), owners


def shard_blocks(model, mesh) -> None:
    """fully_shard every block, then the root (what DMuon leaves to FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_muon(model, **options):
    """dmuon.Muon with HP and the settings under which it equals the reference (torch.optim.Muon with the
    "muon" coefficients and the "original" lr adjustment); `options` adds the rest (replicate_async, ...)."""
    from titan_dmuon import dmuon

    return dmuon.Muon(
        model,
        lr=HP["lr"],
        momentum=HP["momentum"],
        nesterov=True,
        weight_decay=HP["weight_decay"],
        ns_coefficients="muon",
        adjust_lr_fn="original",
        adamw_lr=HP["adamw_lr"],
        adamw_betas=HP["adamw_betas"],
        adamw_eps=HP["adamw_eps"],
        adamw_weight_decay=HP["adamw_weight_decay"],
        **options,
    )


def check_i1_i2_i3(model, owners, layout: str) -> None:
    """After backward: I1 one global owner, I2 `_owned_data` on the owner's column, I3 grads on the owner."""
    st = model._dmuon_state
    me = (st.shard_rank, st.replicate_rank)
    flags = torch.tensor([int(dp.is_owner) for dp in st.dparams])
    dist.all_reduce(flags)
    assert flags.tolist() == [1] * len(st.dparams), "I1: every param needs exactly one global owner"
    for dp in st.dparams:
        owner = owners[dp.param]
        coord = owner if isinstance(owner, tuple) else ((0, owner) if layout == "ddp" else (owner, 0))
        assert dp.is_owner == (me == coord), f"I1 {dp.fqn}"
        assert (dp._owned_data is not None) == dp.in_owner_column, f"I2 {dp.fqn}"
        assert (dp._reduced_grad is not None) == dp.is_owner, f"I3 {dp.fqn}"


def check_i4(model) -> None:
    """After the publish is consumed: every rank of an owner's column holds identical `_owned_data`."""
    st = model._dmuon_state
    st.drain_publish()
    if st.replicate_group is None:
        return
    for dp in st.dparams:
        if not dp.in_owner_column:
            continue
        gathered = [torch.empty_like(dp._owned_data) for _ in range(st.replicate_size)]
        dist.all_gather(gathered, dp._owned_data.contiguous(), group=st.replicate_group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"I4 {dp.fqn}"


def train(
    rank: int,
    world_size: int,
    layout: str,
    mesh_shape: tuple[int, ...],
    steps: int = 8,
    *,
    z3: bool = True,
    replicate_async: bool = True,
    check_every_step: bool = True,
):
    from titan_dmuon import dmuon

    model, opt, owners = build(layout, mesh_shape, z3=z3, replicate_async=replicate_async)
    st = model._dmuon_state
    losses, ledgers, ns_calls = [], [], []
    for step in range(steps):
        loss = model(batch(step, rank, B, D))
        loss.backward()
        if check_every_step:
            check_i1_i2_i3(model, owners, layout)
        opt.step()
        opt.zero_grad()
        if check_every_step and not replicate_async:
            check_i4(model)
        ns_calls.append(opt.last_step_stats["ns_calls"])
        ledgers.append(dict(st.ledger.last_step))
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / world_size)
    check_i4(model)
    return dict(
        losses=losses,
        ledgers=ledgers,
        ns_calls=ns_calls,
        sd=dmuon.get_model_state_dict(model),
        osd=dmuon.get_optimizer_state_dict(model, opt),
        p_m=sum(dp.numel for dp in st.dparams),
        p_col=sum(dp.numel for dp in st.dparams if dp.in_owner_column),
        coord=(st.shard_rank, st.replicate_rank),
        n_dedicated=len(st.dparams),
        owned=[dp.fqn for dp in dmuon.get_owned_params(model)],
    )
