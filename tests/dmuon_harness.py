"""One training harness for the DMuon distributed tests: builds the model on a 1D FSDP2, HSDP or DDP
(dmuon.replicate, or torch's DistributedDataParallel) layout, trains it (optionally with grad accumulation
under a chosen no_sync), checks the invariants I1-I4 (docs/dmuon.md, Invariants) on every rank as it goes,
and records per step what the parity checks compare with the single-process reference: the loss, the global
grad norm (before the step) and the owners' momentum buffers (after it).

NS normalizes its input, so a grad reduced with the wrong scale (SUM instead of AVG) leaves losses and
weights almost unchanged: only the grad norms and the momentum buffers show it.

DMuon runs fp32 Newton-Schulz here on every device (its default is bf16 on CUDA and on CPUs with native bf16
matmuls; the reference's is fp32). Under TITAN_DMUON_TEST_BACKEND=nccl (tests/_dist.py) the ranks build on
`cuda:rank` and the parity tolerance is `parity_rtol()`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests._dist import backend_name, rank_device
from tests.reference import (
    assert_rel_close,
    fp32_torch_muon,
    grad_norm,
    match_groups,
    momentum_buffers,
    reference_optimizers,
)
from tests.tiny_models import TinyMLP, batch, proj_predicate

D, FF, LAYERS, B = 32, 64, 4, 4  # 4 layers = 4 merged owner units: every slot of 4 ranks owns one
DDP_LAYOUTS = ("ddp", "torch_ddp")
HP = dict(
    lr=0.02,
    momentum=0.95,
    weight_decay=0.1,
    adamw_lr=1e-3,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    adamw_weight_decay=0.01,
)
# Norm-wise relative tolerance of the parity checks per backend: on CUDA (TF32 off, fp32 NS) cuBLAS sums its
# products in another order than the CPU reference, ~1e-7 per product, which 8 steps of training compound.
PARITY_RTOL = {"gloo": 1e-5, "nccl": 1e-4}
# The Muon settings the layout tests run with; `options` (see `muon_kwargs`) override them.
MUON_DEFAULTS = dict(nesterov=True, ns_coefficients="muon", adjust_lr_fn="original")


def muon_kwargs(options: dict | None = None) -> dict:
    """HP + MUON_DEFAULTS + `options`: the keyword arguments of dmuon.Muon and of `reference_optimizers`.
    `options["groups"]` lists per-group overrides `{"match": name substring, **keys}` (see
    tests.reference.reference_optimizers); `build_muon` turns them into dmuon.Muon's `param_groups`."""
    return {**HP, **MUON_DEFAULTS, **(options or {})}


def parity_rtol() -> float:
    """The parity tolerance of this run's backend (PARITY_RTOL)."""
    return PARITY_RTOL[backend_name()]


def reference(world_size: int, steps: int, options: dict | None = None, micro: int = 1) -> dict:
    """Single process, the ranks' batches concatenated: torch.optim.Muon (fp32 NS) + AdamW. Per step: the
    loss (the mean over `micro` accumulated micro-batches), the global grad norm before the step and the
    momentum buffers after it; the final state dict."""
    torch.manual_seed(0)
    model = TinyMLP(D, FF, LAYERS)
    muon, adamw = reference_optimizers(model, proj_predicate, **muon_kwargs(options))
    losses, norms, momentum = [], [], []
    with fp32_torch_muon():
        for step in range(steps):
            loss = 0.0
            for m in range(micro):
                micro_loss = model(torch.cat([batch(step * micro + m, r, B, D) for r in range(world_size)]))
                (micro_loss / micro if micro > 1 else micro_loss).backward()
                loss = loss + micro_loss.detach() / micro
            norms.append(grad_norm(model))
            muon.step()
            adamw.step()
            momentum.append(momentum_buffers(model, muon))
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, sd=sd, norms=norms, momentum=momentum)


def build(layout: str, mesh_shape: tuple[int, ...], *, z3: bool = True, replicate_async: bool = True, options=None):
    """layout: "fsdp" (1D), "hsdp" ((R, G) mesh), "ddp" (dedicate_params_ddp + replicate), "torch_ddp"
    (dedicate_params_ddp, then torch's DistributedDataParallel: the returned model is the DDP wrapper)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    model = TinyMLP(D, FF, LAYERS).to(device)  # initialized on CPU: the reference's init on every backend
    if layout == "fsdp":
        mesh = init_device_mesh(device.type, mesh_shape)
        owners = dmuon.dedicate_params(model, mesh, proj_predicate, reshard_after_forward=z3)
        fsdp_mesh = mesh
    elif layout == "hsdp":
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("replicate", "shard"))
        owners = dmuon.dedicate_params(
            model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], reshard_after_forward=z3
        )
        fsdp_mesh = mesh
    elif layout == "ddp":
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp",))
        owners = dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        dmuon.replicate(model, mesh)
        fsdp_mesh = None
    elif layout == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp",))
        owners = dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        model = DistributedDataParallel(model, process_group=mesh.get_group())
        fsdp_mesh = None
    else:
        raise ValueError(layout)
    if fsdp_mesh is not None:
        shard_blocks(model, fsdp_mesh)
    return model, build_muon(model, options, replicate_async=replicate_async), owners


def shard_blocks(model, mesh) -> None:
    """fully_shard every block, then the root (what DMuon leaves to FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_muon(model, options: dict | None = None, **extra):
    """dmuon.Muon with `muon_kwargs(options)` (by default the settings under which it equals the reference:
    the "muon" coefficients and the "original" lr adjustment), the `groups` overrides as `param_groups`
    (matched by name, after fully_shard: FSDP2 replaces the params it shards); `extra` adds the rest
    (replicate_async, ...)."""
    from titan_dmuon import dmuon

    kwargs = muon_kwargs(options)
    # the reference's NS dtype, on every device (the default is bf16 on CUDA and on CPUs with native bf16)
    extra.setdefault("ns_dtype", torch.float32)
    groups = kwargs.pop("groups", ())
    matched = match_groups(model.named_parameters(), groups)
    param_groups = [
        {"params": ps, **{k: v for k, v in g.items() if k != "match"}} for g, ps in zip(groups, matched, strict=True)
    ]
    assert all(g["params"] for g in param_groups), "a param group override matched no param"
    return dmuon.Muon(model, param_groups=param_groups or None, **kwargs, **extra)


def dmuon_state(model):
    """The model's DMuonState (through a torch DDP wrapper): the internals the invariant checks read."""
    from titan_dmuon.dmuon.state import state_of

    return state_of(model, "tests")


def owner_momentum(model, opt) -> dict[str, tuple]:
    """This rank's momentum buffers (the owners' own `opt.state`, no collective, no drain of an async
    publish): fqn -> (TP shard dim or None, TP rank, TP size, a copy of the (TP-local) buffer). A TP matrix whose
    momentum its TP owner keeps whole (`tp_gather="backward"`) reports it as one whole buffer, from that rank only."""
    out = {}
    for dp in dmuon_state(model).dparams:
        st = opt.state.get(dp.param, {})
        if dp.is_owner and "momentum_buffer" in st:
            buf = st["momentum_buffer"].detach().clone()
            if dp.tp_group is None or tuple(buf.shape) == tuple(dp.full_shape) != tuple(dp._orig_size):
                out[dp.fqn] = (None, 0, 1, buf)
            else:
                out[dp.fqn] = (dp.shard_dim, dp.tp_rank, dp.tp_group.size(), buf)
    return out


def merge_momentum(per_rank: list[dict[str, tuple]]) -> dict[str, torch.Tensor]:
    """One step's `owner_momentum` of every rank -> full buffers by fqn; each (fqn, TP rank) from exactly
    one owner (I1), TP shards concatenated on their shard dim."""
    shards: dict[str, dict[int, tuple]] = {}
    for rank_bufs in per_rank:
        for fqn, (dim, tp_rank, size, buf) in rank_bufs.items():
            assert tp_rank not in shards.setdefault(fqn, {}), f"two owners hold the momentum of {fqn}"
            shards[fqn][tp_rank] = (dim, size, buf)
    out = {}
    for fqn, by_tp in shards.items():
        dim, size, _ = next(iter(by_tp.values()))
        assert sorted(by_tp) == list(range(size)), f"{fqn}: momentum shards of TP ranks {sorted(by_tp)}"
        bufs = [by_tp[i][2] for i in range(size)]
        out[fqn] = bufs[0] if dim is None else torch.cat(bufs, dim=dim)
    return out


def assert_matches_reference(results: list[dict], ref: dict, rtol: float | None = None) -> None:
    """Every rank's losses and global grad norms, rank 0's full state dict and every step's owners' momentum
    buffers (merged over ranks) against the reference, at `rtol` (norm-wise for tensors; default
    `parity_rtol()`)."""
    rtol = parity_rtol() if rtol is None else rtol
    steps = len(ref["losses"])
    for i, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0, msg=lambda m: f"losses: {m}"
        )
        # the grad norm is the one check of the grads' scale that NS cannot normalize away
        norms, want = torch.tensor(r["norms"], dtype=torch.float64), torch.tensor(ref["norms"], dtype=torch.float64)
        torch.testing.assert_close(norms, want, rtol=rtol, atol=0, msg=lambda m: f"global grad norms: {m}")
        assert len(r["momentum"]) == steps, f"rank {i}"
    assert set(results[0]["sd"]) == set(ref["sd"])
    for k, v in ref["sd"].items():
        assert_rel_close(results[0]["sd"][k], v, rtol, k)
    for step in range(steps):
        got = merge_momentum([r["momentum"][step] for r in results])
        want = ref["momentum"][step]
        assert set(got) == set(want), f"step {step}: momentum of {sorted(set(got) ^ set(want))}"
        for k, v in want.items():
            assert_rel_close(got[k], v, rtol, f"step {step} momentum {k}")


def grad_left_to_owner(p: torch.Tensor) -> bool:
    """What a dedicated param shows after its grad was reduced onto the owner: no grad, or DMuon's placeholder,
    an all-zero sparse tensor of its shape (docs/dmuon.md, "Gradient accumulation")."""
    g = p.grad
    if g is None:
        return True
    return g.layout == torch.sparse_coo and g.shape == p.shape and not g.coalesce().values().any()


def check_i1_i2_i3(model, owners, layout: str) -> None:
    """After backward: I1 one global owner, I2 `_owned_data` on the owner's column, I3 the reduced grad on the
    owner only and no `param.grad` left on any rank (under torch DDP: DDP did not reduce them as well)."""
    st = dmuon_state(model)
    me = (st.shard_rank, st.replicate_rank)
    flags = torch.tensor([int(dp.is_owner) for dp in st.dparams], device=rank_device())
    dist.all_reduce(flags)
    assert flags.tolist() == [1] * len(st.dparams), "I1: every param needs exactly one global owner"
    for dp in st.dparams:
        owner = owners[dp.param]
        coord = owner if isinstance(owner, tuple) else ((0, owner) if layout in DDP_LAYOUTS else (owner, 0))
        assert dp.is_owner == (me == coord), f"I1 {dp.fqn}"
        assert (dp._owned_data is not None) == dp.in_owner_column, f"I2 {dp.fqn}"
        assert (dp._reduced_grad is not None) == dp.is_owner, f"I3 {dp.fqn}"
        assert grad_left_to_owner(dp.param), f"I3 {dp.fqn}: the param kept a grad (reduced by something else too?)"


def check_i4(model) -> None:
    """After the publish is consumed: every rank of an owner's column holds identical `_owned_data`."""
    st = dmuon_state(model)
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
    options: dict | None = None,
    micro: int = 1,
    no_sync: tuple[str, ...] = ("none",),
):
    """`micro` > 1 accumulates that many micro-batches per step, each loss divided by `micro`; all but the last
    run inside the no_sync style `no_sync[step % len(no_sync)]` (see `_no_sync`)."""
    from titan_dmuon import dmuon

    model, opt, owners = build(layout, mesh_shape, z3=z3, replicate_async=replicate_async, options=options)
    st = dmuon_state(model)
    losses, ledgers, ns_calls, norms, momentum = [], [], [], [], []
    for step in range(steps):
        loss = 0.0
        for m in range(micro):
            with _no_sync(model, no_sync[step % len(no_sync)] if m < micro - 1 else "none"):
                micro_loss = model(batch(step * micro + m, rank, B, D).to(rank_device()))
                (micro_loss / micro if micro > 1 else micro_loss).backward()
            loss = loss + micro_loss.detach() / micro
        if check_every_step:
            check_i1_i2_i3(model, owners, layout)
        norms.append(dmuon.clip_grad_norm_(model, opt, max_norm=float("inf")).item())  # the norm; never clips
        opt.step()
        momentum.append(owner_momentum(model, opt))
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
        layout=layout,
        losses=losses,
        norms=norms,
        momentum=momentum,
        ledgers=ledgers,
        ns_calls=ns_calls,
        sd=dmuon.get_model_state_dict(model),
        osd=dmuon.get_optimizer_state_dict(model, opt),
        p_m=sum(dp.numel for dp in st.dparams),
        p_col=sum(dp.numel for dp in st.dparams if dp.in_owner_column),
        m_col=sum(1 for dp in st.dparams if dp.in_owner_column),
        coord=(st.shard_rank, st.replicate_rank),
        n_dedicated=len(st.dparams),
        owned=[dp.fqn for dp in dmuon.get_owned_params(model)],
    )


def _no_sync(model, style: str):
    """The grad-accumulation context a user would write: "none"; "dmuon" `dmuon.no_sync(model)` (a DDP wrapper
    included); "torch" DDP's own `model.no_sync()` alone; "both" the two nested; "inner" `dmuon.no_sync` on
    the module inside the DDP wrapper (DDP keeps syncing its params)."""
    import contextlib

    from titan_dmuon import dmuon

    if style == "none":
        return contextlib.nullcontext()
    if style == "dmuon":
        return dmuon.no_sync(model)
    if style == "torch":
        return model.no_sync()
    if style == "both":
        stack = contextlib.ExitStack()
        stack.enter_context(model.no_sync())
        stack.enter_context(dmuon.no_sync(model))
        return stack
    if style == "inner":
        return dmuon.no_sync(model.module)
    raise ValueError(style)
