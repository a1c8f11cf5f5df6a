"""dmuon.clip_grad_norm_ on real gloo ranks makes at most one host sync, and clips every grad right.

Host syncs are counted where a CPU run can see them: the Tensor methods that hand a value to Python (`.item()`,
`.tolist()`, `bool()`, `float()`, ...; on CUDA each waits for the GPU) are wrapped while the function runs (on
NCCL, torch's CUDA sync debug mode counts the real ones as well). Collectives are not host syncs.

The reference is computed without the function, from the grads as they were before it: every rank's pieces
(an owner's reduced grad of a dedicated matrix, TP-local per TP coordinate; the full value of every other grad,
`full_tensor()` of a DTensor) collected in the test process, one plain L2 norm over them, and each piece scaled
by min(1, max_norm / (norm + 1e-6)). Layouts, one spawn of 4 ranks: dp x tp (FSDP2 over the attention
matrices' TP DTensors: _StridedShard / Shard x Shard grads), dp x tp with the dedicated matrices left whole by
the TP plan (as MLA's down projections: each TP slice's owner holds the same whole grad, which the norm counts
once), HSDP (Replicate x Shard grads), DDP + TP (dmuon.replicate_tp: TP DTensor grads) and DDP (dmuon.replicate:
plain grads).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.distributed as dist

from tests._dist import backend_name, rank_device, run_distributed
from tests.dmuon_harness import build_muon, shard_blocks
from tests.tiny_models import TinyLlama, TinyMLP, apply_llama_tp, batch, proj_predicate, seq_batch

WORLD = 4
D, FF, HEADS, LAYERS, B, T = 32, 64, 4, 2, 2, 8
LAYOUTS = ("dp_tp", "dp_tp_whole", "hsdp", "ddp_tp", "ddp")
MAX_HOST_SYNCS = 1  # per call of clip_grad_norm_
FRACTION = 0.3  # max_norm as a fraction of the global norm: every grad is scaled
# The Tensor methods that hand a value to Python: on CUDA each one waits for the GPU.
SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@contextlib.contextmanager
def count_host_syncs():
    """Yield a list that collects the name of every syncing Tensor method called inside the block (and, on
    CUDA, every synchronizing operation torch's sync debug mode reports)."""
    calls: list[str] = []
    saved = {name: (torch.Tensor.__dict__.get(name), getattr(torch.Tensor, name)) for name in SYNCING}

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return fn(self, *args, **kwargs)

        return wrapper

    for name, (_, fn) in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield calls
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        calls.extend("cuda sync" for w in caught if "synchronizing CUDA operation" in str(w.message))
    finally:
        for name, (own, _) in saved.items():
            if own is None:
                delattr(torch.Tensor, name)  # it was inherited: inherit it again
            else:
                setattr(torch.Tensor, name, own)


def _mlp_matrices(name: str, p: torch.Tensor) -> bool:
    """Under TP DMuon takes the MLP matrices only: the attention ones stay FSDP2's (or replicate_tp's), TP
    DTensors whose grads FSDP2 shards again (_StridedShard over the column-wise TP shards)."""
    return ".mlp." in name and p.ndim == 2


def _build(layout: str):
    """(model, optimizer, DP rank) of `layout` on this rank, after one forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    if layout in ("dp_tp", "dp_tp_whole", "ddp_tp"):
        model = TinyLlama(D, FF, HEADS, LAYERS).to(device)
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
        if layout == "dp_tp_whole":  # TP on the attention only: the MLPs whole on every TP rank, same grads there
            apply_llama_tp(model, mesh["tp"], mlp=False)
        else:
            apply_llama_tp(model, mesh["tp"])
        if layout in ("dp_tp", "dp_tp_whole"):
            dmuon.dedicate_params(model, mesh["dp"], _mlp_matrices)
            shard_blocks(model, mesh["dp"])
        else:
            dmuon.dedicate_params_ddp_tp(model, mesh["dp"], _mlp_matrices)
            dmuon.replicate_tp(model, mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
        x = seq_batch(0, dp_rank, B, T, D)
    else:
        model = TinyMLP(D, FF, LAYERS).to(device)
        if layout == "hsdp":
            mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
            dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
            shard_blocks(model, mesh)
        else:
            mesh = init_device_mesh(device.type, (WORLD,), mesh_dim_names=("dp",))
            dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
            dmuon.replicate(model, mesh)
        x = batch(0, dist.get_rank(), B, D)
    opt = build_muon(model)
    model(x.to(device)).backward()
    return model, opt


def _pieces(model) -> dict[tuple, torch.Tensor]:
    """The grads this rank holds, as the reference sees them: an owner's reduced grad of each dedicated matrix
    (a TP DTensor's keyed by its TP coordinate; a plain one, whole in every TP slice, by its name alone), the full
    value of every other grad (collective for a DTensor)."""
    from torch.distributed.tensor import DTensor

    st = model._dmuon_state
    out = {}
    for dp in st.dparams:  # `reduced_grad()`: with the clip factor a TP gather in flight kept applied
        if dp.is_owner and (g := dp.reduced_grad()) is not None:
            key = ("dedicated", dp.fqn, st.tp_rank) if isinstance(dp.param, DTensor) else ("whole", dp.fqn)
            out[key] = g.detach().float().cpu().clone()
    for name, p in model.named_parameters():
        if p not in st.by_param and p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[("other", name)] = g.detach().float().cpu().clone()
    return out


def _placements(model) -> set[str]:
    from torch.distributed.tensor import DTensor

    st = model._dmuon_state
    return {
        type(pl).__name__
        for p in model.parameters()
        if p not in st.by_param and isinstance(p.grad, DTensor)
        for pl in p.grad.placements
    }


def _clip_every_layout(rank: int, world_size: int) -> dict:
    from titan_dmuon import dmuon

    out = {}
    for layout in LAYOUTS:
        model, opt = _build(layout)
        with count_host_syncs() as norm_syncs:  # max_norm inf: the norm alone (the grads scaled by 1.0)
            norm = dmuon.clip_grad_norm_(model, opt, max_norm=float("inf"))
        max_norm = FRACTION * norm.item()  # clip at FRACTION of it: every grad is scaled
        before = _pieces(model)
        with count_host_syncs() as syncs:
            clipped_norm = dmuon.clip_grad_norm_(model, opt, max_norm=max_norm)
        out[layout] = dict(
            max_norm=max_norm,
            before=before,
            after=_pieces(model),
            norm=norm.detach().cpu(),
            clipped_norm=clipped_norm.detach().cpu(),
            syncs=(list(norm_syncs), list(syncs)),
            placements=_placements(model),
        )
    return out


def _reference(per_rank: list[dict]) -> tuple[dict, float]:
    """The pieces of all ranks, each once (a dedicated piece on its one owner, a whole one on one owner per TP
    slice, the others the same on every rank), and the plain L2 norm over them."""
    pieces: dict[tuple, torch.Tensor] = {}
    for r in per_rank:
        for key, t in r["before"].items():
            if key in pieces:
                assert key[0] in ("other", "whole"), f"{key} has two owners"
                torch.testing.assert_close(t, pieces[key], rtol=0, atol=0)  # replicated: the same everywhere
            else:
                pieces[key] = t
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in pieces.values()))
    return pieces, norm


def test_clip_grad_norm_one_host_sync_and_reference():
    results = run_distributed(_clip_every_layout, WORLD, timeout=300)
    for layout in LAYOUTS:
        per_rank = [r[layout] for r in results]
        pieces, ref_norm = _reference(per_rank)
        owned = "dedicated" if layout in ("dp_tp", "ddp_tp") else "whole"
        assert any(k[0] == owned for k in pieces) and any(k[0] == "other" for k in pieces), layout
        if layout == "dp_tp_whole":  # each whole matrix has an owner in each of the 2 TP slices
            holders = [sum(key in r["before"] for r in per_rank) for key in pieces if key[0] == "whole"]
            assert holders and set(holders) == {2}, holders
        max_norm = per_rank[0]["max_norm"]
        coef = min(1.0, max_norm / (ref_norm + 1e-6))
        assert coef < 0.5, (layout, coef)
        for what in ("norm", "clipped_norm"):  # one global value, the same on every rank
            norms = torch.stack([r[what] for r in per_rank])
            assert torch.equal(norms, norms[:1].expand_as(norms)), f"{layout}: {what} differs across ranks {norms}"
            assert float(norms[0]) == pytest.approx(ref_norm, rel=1e-5), (layout, what)
        for rank, r in enumerate(per_rank):
            assert r["max_norm"] == max_norm
            for calls in r["syncs"]:
                assert len(calls) <= MAX_HOST_SYNCS, f"{layout}, rank {rank}: host syncs {r['syncs']}"
            assert r["after"].keys() == r["before"].keys()
            for key, t in r["after"].items():
                torch.testing.assert_close(t, pieces[key] * coef, rtol=1e-6, atol=1e-9, msg=f"{layout} {key}")
    placements = {layout: set().union(*(r[layout]["placements"] for r in results)) for layout in LAYOUTS}
    assert {"_StridedShard", "Shard"} <= placements["dp_tp"], placements  # FSDP2 x TP
    assert {"Replicate", "Shard"} <= placements["hsdp"], placements
    assert placements["ddp_tp"] and placements["ddp"] == set(), placements  # TP DTensors; plain grads


@pytest.mark.skipif(backend_name() != "gloo", reason="the counter's own check runs on CPU")
def test_the_counter_sees_host_syncs():
    own = {name: torch.Tensor.__dict__.get(name) for name in SYNCING}
    t = torch.ones(2)
    with count_host_syncs() as syncs:
        t.sum().item()
        if t.any():
            pass
        float(t[0])
        t.tolist()
    t.sum().item()  # outside the block: not counted, and every method is as it was
    assert syncs == ["item", "__bool__", "__float__", "tolist"]
    assert {name: torch.Tensor.__dict__.get(name) for name in SYNCING} == own
