"""DMuon's reduce dtype (`dedicate_params(..., reduce_dtype=)`, wired to `training.mixed_precision_reduce`) on 4
real gloo ranks, HSDP 2 x 2 (both reduce stages): with bf16 params, the Muon grads reduced in fp32 equal an
fp32 average of the same bf16 grads (the inputs are exact in bf16: only fp32 summation order differs), and the
grads reduced in bf16 do not (they are off by bf16 rounding), so a reduce dtype that is ignored is caught."""

from __future__ import annotations

import pytest
import torch

from tests._dist import rank_device, run_distributed
from tests.dmuon_harness import FF, LAYERS, B, D
from tests.tiny_models import TinyMLP, batch, proj_predicate

WORLD = 4


def _reduce_once(rank: int, world_size: int, reduce_dtype: torch.dtype) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    model = TinyMLP(D, FF, LAYERS).to(device)
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    dmuon.dedicate_params(
        model,
        mesh["shard"],
        proj_predicate,
        replicate_mesh=mesh["replicate"],
        param_dtype=torch.bfloat16,
        reduce_dtype=reduce_dtype,
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    st = model._dmuon_state
    local: dict[str, torch.Tensor] = {}
    for g in st.groups:  # each rank's own bf16 grads, as they go into the reduce
        reduce = g.reduce_grads

        def capture(g=g, reduce=reduce):
            for dp in g.params:
                if dp.local_grad is not None:
                    local[dp.fqn] = dp.local_grad.detach().clone()
            reduce()

        g.reduce_grads = capture
    model(batch(0, rank, B, D).to(device)).backward()
    return dict(
        local=local,
        reduced={dp.fqn: dp._reduced_grad.clone() for dp in st.dparams if dp.is_owner},
        reduce_bytes=st.ledger.current_bytes["reduce"],
        reduce_elements=st.ledger.current["reduce"],
    )


def _run(rank: int, world_size: int) -> dict:
    return {str(dtype): _reduce_once(rank, world_size, dtype) for dtype in (torch.float32, torch.bfloat16)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.slow
def test_bf16_params_reduce_their_muon_grads_in_fp32():
    results = run_distributed(_run, WORLD)
    for name, lo, hi in (("torch.float32", 0.0, 1e-6), ("torch.bfloat16", 1e-4, 2e-2)):
        runs = [r[name] for r in results]
        assert all(g.dtype == torch.bfloat16 for r in runs for g in r["local"].values()), "the grads are not bf16"
        owned = {fqn: g for r in runs for fqn, g in r["reduced"].items()}
        assert set(owned) == set(runs[0]["local"]), "every Muon matrix has one owner holding its reduced grad"
        for fqn, got in owned.items():
            assert got.dtype == torch.float32, fqn  # the owner's momentum takes the fp32 result
            # fp32 reference reduce of the same bf16 grads (exact in fp32), averaged over the 4 ranks
            want = torch.stack([r["local"][fqn].float() for r in runs]).mean(0)
            err = _rel(got, want)
            assert lo <= err <= hi, f"{name} reduce of {fqn}: relative error {err:.2e} outside [{lo}, {hi}]"
        # the ledger moves reduce-dtype bytes: 4 per element in fp32, 2 in bf16
        size = 4 if name == "torch.float32" else 2
        for r in runs:
            assert r["reduce_bytes"] == pytest.approx(size * r["reduce_elements"]), name


def _ddp_bf16(rank: int, world_size: int) -> dict:
    """DDP with bf16 live params, initialized differently on every rank (a user who forgot to seed)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(rank)
    device = rank_device()
    model = TinyMLP(D, FF, LAYERS).to(device=device, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
    dmuon.replicate(model, mesh)
    st = model._dmuon_state
    start = {dp.fqn: dp.param.detach().clone() for dp in st.dparams}
    return dict(
        start=start,
        masters={dp.fqn: dp._owned_data.clone() for dp in st.dparams if dp.is_owner},
        reduce_dtypes={str(g.reduce_dtype) for g in st.groups},
    )


@pytest.mark.slow
def test_ddp_bf16_starts_from_the_owners_weights_and_reduces_in_fp32():
    """Under dedicate_params_ddp every rank starts from the owner's weights (its bf16 live copy refreshed from the
    owner's fp32 master after the first publish), and the Muon grads are reduced in fp32, as on the FSDP path."""
    results = run_distributed(_ddp_bf16, WORLD)
    masters = {fqn: m for r in results for fqn, m in r["masters"].items()}
    assert set(masters) == set(results[0]["start"])
    for rank, r in enumerate(results):
        assert r["reduce_dtypes"] == {"torch.float32"}, rank
        for fqn, live in r["start"].items():
            assert live.dtype == torch.bfloat16
            assert torch.equal(live, masters[fqn].to(torch.bfloat16)), f"rank {rank} {fqn}: not the owner's weights"
