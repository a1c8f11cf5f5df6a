"""Per-head DMuon (docs/dmuon.md, "Per-head Muon") on real gloo ranks: 1D FSDP (2 ranks), HSDP 2x2 and dp2 x tp2
match a single-process reference that runs torch.optim.Muon on every head block as a parameter of its
own, plus AdamW (losses, global grad norms, weights and the owners' momentum at 5e-5). On dp2 x tp2 the heads of
q/k/v (column-parallel, dim 0) and o (row-parallel, dim 1) lie whole in their TP shards, so the ledger has no TP
gather or scatter for them; gate's column blocks cross its row-sharded TP shards and take gather -> per-head NS ->
scatter, like the whole matrices up and down."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import rank_device, run_distributed
from tests.dmuon_harness import HP, build_muon, merge_momentum, owner_momentum, shard_blocks
from tests.dmuon_tp_harness import FF, HEADS, LAYERS, B, D, T
from tests.reference import assert_rel_close, fp32_torch_muon, grad_norm
from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate, seq_batch
from tests.unit.dmuon.test_per_head import PerHeadReference

STEPS, RTOL, DEADLINE = 4, 5e-5, 180
HD = D // HEADS
ATTENTION = {
    **{f"layers.{i}.self_attn.{p}_proj.weight": (0, HD) for i in range(LAYERS) for p in "qkv"},
    **{f"layers.{i}.self_attn.o_proj.weight": (1, HD) for i in range(LAYERS)},
}
# gate (64x32) in 2 column blocks: under TP it is row-sharded (column-parallel), so its blocks cross the TP shards
BLOCKS = {**ATTENTION, **{f"layers.{i}.mlp.gate_proj.weight": (1, FF // 4) for i in range(LAYERS)}}
OPTIONS = dict(per_head=True, per_head_wo=True)


def reference(dp_size: int) -> dict:
    """One process, the DP ranks' batches concatenated: per-block torch.optim.Muon (fp32 NS) + AdamW."""
    torch.manual_seed(0)
    model = TinyLlama(D, FF, HEADS, LAYERS)
    opt = PerHeadReference(model, proj_predicate, BLOCKS, **HP)
    losses, norms, momentum = [], [], []
    with fp32_torch_muon():
        for step in range(STEPS):
            loss = model(torch.cat([seq_batch(step, r, B, T, D) for r in range(dp_size)]))
            loss.backward()
            norms.append(grad_norm(model))
            opt.step()
            momentum.append(opt.momentum())
            opt.zero_grad()
            losses.append(loss.item())
    return dict(losses=losses, norms=norms, momentum=momentum, sd={k: v.clone() for k, v in model.state_dict().items()})


def per_head_train(rank: int, world_size: int, layout: str, shape: tuple[int, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    model = TinyLlama(D, FF, HEADS, LAYERS).to(device)
    if layout == "fsdp":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp",))
        dmuon.dedicate_params(model, mesh, proj_predicate, head_blocks=BLOCKS)
        shard_blocks(model, mesh)
        dp_rank = mesh.get_local_rank()
    elif layout == "hsdp":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(
            model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], head_blocks=BLOCKS
        )
        shard_blocks(model, mesh)
        dp_rank = dist.get_rank()
    elif layout == "dp_tp":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["dp"], proj_predicate, head_blocks=BLOCKS)
        shard_blocks(model, mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
    else:
        raise ValueError(layout)
    opt = build_muon(model, OPTIONS)
    st = model._dmuon_state
    losses, norms, momentum, ledgers, ns_calls = [], [], [], [], []
    for step in range(STEPS):
        loss = model(seq_batch(step, dp_rank, B, T, D).to(device))
        loss.backward()
        norms.append(dmuon.clip_grad_norm_(model, opt, max_norm=float("inf")).item())
        opt.step()
        momentum.append(owner_momentum(model, opt))
        opt.zero_grad()
        ledgers.append(dict(st.ledger.last_step))
        ns_calls.append(opt.last_step_stats["ns_calls"])
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / world_size)
    return dict(
        losses=losses,
        norms=norms,
        momentum=momentum,
        ledgers=ledgers,
        ns_calls=ns_calls,
        sd=dmuon.get_model_state_dict(model),
        n_dedicated=len(st.dparams),
        # the TP matrices this rank's TP slice owns: (fqn, full elements, TP size)
        tp_owned=[
            (dp.fqn, dp.full_shape.numel(), dp.tp_group.size()) for dp in st.dparams if dp.is_owner and dp.tp_group
        ],
    )


def check_parity(results: list[dict], ref: dict) -> None:
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=0)
        for k, v in ref["sd"].items():
            assert_rel_close(r["sd"][k], v, RTOL, k)
    for step in range(STEPS):
        got = merge_momentum([r["momentum"][step] for r in results])
        assert set(got) == set(ref["momentum"][step]), step
        for k, v in ref["momentum"][step].items():
            assert_rel_close(got[k], v, RTOL, f"step {step} momentum {k}")
        assert sum(r["ns_calls"][step] for r in results) == results[0]["n_dedicated"]  # one NS per matrix


LAYOUTS = {"fsdp": (2,), "hsdp": (2, 2), "dp_tp": (2, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_head_parity(layout):
    shape = LAYOUTS[layout]
    world = 1
    for n in shape:
        world *= n
    results = run_distributed(per_head_train, world, layout, shape, timeout=DEADLINE)
    check_parity(results, reference(dp_size=world // (2 if layout == "dp_tp" else 1)))
    if layout != "dp_tp":
        return
    # The ledger: TP gathers and scatters (fp32) carry only the matrices whose blocks do not lie in their TP shards
    # (gate) and the whole ones (up, down); q/k/v/o, whose heads do, move nothing over the TP axis.
    assert {fqn for r in results for fqn, _, _ in r["tp_owned"]} >= set(ATTENTION)  # they are owned somewhere
    for r in results:
        expected = sum((t - 1) / t * n for fqn, n, t in r["tp_owned"] if fqn not in ATTENTION)
        for led in r["ledgers"]:
            assert led["tp_gather"] == pytest.approx(expected, rel=1e-12)
            assert led["tp_scatter"] == pytest.approx(expected, rel=1e-12)
