"""The DMuon TP harness (docs/dmuon.md, Tensor parallelism): a TinyLlama on a dp x tp, replicate x shard x tp,
DDP + TP or plain 1D layout trained on real ranks (`tp_train`), and the single-process torch.optim.Muon + AdamW
reference it must match (`tp_reference`). tests/distributed/test_dmuon_tp.py checks them; tests/gpu_parity.py
runs them on NCCL."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from unittest import mock

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon

from tests._dist import rank_device
from tests.dmuon_harness import HP, build_muon, owner_momentum, shard_blocks
from tests.ns_reference import reference_ns
from tests.reference import fp32_torch_muon, grad_norm, momentum_buffers, reference_optimizers
from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate, seq_batch

# FF = 4 D: under TP the MLP's gate/up (column-parallel, FF x D) and down (row-parallel, D x FF) are split on their
# long side with l/s = 4, above the 3 Gram all-reduces of the "muon" coefficients, so tp_distributed_gram_policy
# "beneficial" takes the Gram for them and keeps the gather for the square q/k/v/o (tests/distributed/test_dmuon_tp.py)
D, FF, HEADS, LAYERS, B, T, STEPS = 32, 128, 4, 2, 2, 8, 6


@contextlib.contextmanager
def fp32_gram_torch_muon():
    """torch.optim.Muon with its NS the fp32 Gram formulation on every matrix (square ones too): what DMuon's TP
    distributed Gram computes (tests/ns_reference.py)."""

    def ns(grad, ns_coefficients, ns_steps, eps):
        return reference_ns(grad, ns_coefficients, ns_steps, eps, dtype=torch.float32, gram=True)

    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", ns):
        yield


def tp_reference(dp_size: int, gram_matrices: Collection[str] = ()):
    """Single process, the `dp_size` DP ranks' batches concatenated: (losses, state dict, global grad norms before
    each step, momentum buffers after it) of STEPS steps. The matrices named in `gram_matrices` (those DMuon's TP
    distributed Gram orthogonalizes) take the Gram formulation of NS, the others the direct one."""
    torch.manual_seed(0)
    model = TinyLlama(D, FF, HEADS, LAYERS)
    muon, adamw = reference_optimizers(model, proj_predicate, **HP)
    optimizers = [(muon, fp32_torch_muon)]
    if gram_matrices:  # a second torch.optim.Muon on them (its AdamW never steps), NS in the Gram formulation
        gram_muon, _ = reference_optimizers(model, lambda n, p: n in gram_matrices, **HP)
        gram_ids = {id(p) for g in gram_muon.param_groups for p in g["params"]}
        assert len(gram_ids) == len(gram_matrices), sorted(gram_matrices)
        for group in muon.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gram_ids]
        optimizers.append((gram_muon, fp32_gram_torch_muon))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in (*(o for o, _ in optimizers), adamw)]
    losses, norms, momentum = [], [], []
    for step in range(STEPS):
        loss = model(torch.cat([seq_batch(step, r, B, T, D) for r in range(dp_size)]))
        loss.backward()
        norms.append(grad_norm(model))
        for o, ns in optimizers:
            with ns():
                o.step()
        adamw.step()
        momentum.append({k: v for o, _ in optimizers for k, v in momentum_buffers(model, o).items()})
        for sched in schedules:
            sched.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, momentum


def lr_factor(step: int) -> float:
    """A schedule that changes every step: an update applied late (async TP) must use its own step's lr."""
    return 1.0 / (1 + step)


def tp_train(
    rank: int,
    world_size: int,
    layout: str,
    shape: tuple[int, ...],
    replicate_async: bool = True,
    tp_buffer_reuse=False,
    tp_distributed_gram: bool = False,
    tp_distributed_gram_policy: str = "beneficial",
):
    """One rank of a TinyLlama run on `layout` ("plain", "dp_tp", "3d", "ddp_tp") over a mesh of `shape`: per step
    the loss, the global grad norm, this rank's owner momentum and NS calls; the final state dicts and owned params."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()  # CPU, or cuda:rank under TITAN_DMUON_TEST_BACKEND=nccl
    model = TinyLlama(D, FF, HEADS, LAYERS).to(device)
    if layout == "plain":  # 1D DMuon, no TP at all
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp",))
        dmuon.dedicate_params(model, mesh, proj_predicate)
        fsdp_mesh, dp_mesh = mesh, mesh
    elif layout == "dp_tp":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["dp"], proj_predicate, tp_buffer_reuse=tp_buffer_reuse)
        fsdp_mesh = dp_mesh = mesh["dp"]
    elif layout == "3d":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
        fsdp_mesh = dp_mesh = mesh["replicate", "shard"]
    elif layout == "ddp_tp":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params_ddp_tp(model, mesh["dp"], proj_predicate)
        dmuon.replicate_tp(model, mesh["dp"])
        fsdp_mesh, dp_mesh = None, mesh["dp"]
    else:
        raise ValueError(layout)
    if fsdp_mesh is not None:
        shard_blocks(model, fsdp_mesh)
    opt = build_muon(
        model,
        replicate_async=replicate_async,
        tp_distributed_gram=tp_distributed_gram,
        tp_distributed_gram_policy=tp_distributed_gram_policy,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    dp_rank = dp_mesh.get_coordinate()
    dp_rank = dp_rank[0] if len(dp_rank) == 1 else dp_rank[0] * dp_mesh.size(1) + dp_rank[1]
    st = model._dmuon_state
    losses, ns_calls, norms, momentum = [], [], [], []
    for step in range(STEPS):
        loss = model(seq_batch(step, dp_rank, B, T, D).to(device))
        loss.backward()
        norms.append(dmuon.clip_grad_norm_(model, opt, max_norm=float("inf")).item())  # global norm, never clips
        for dp in st.dparams:  # I3 per TP coordinate: the DP owner of each shard holds its grad
            assert (dp._reduced_grad is not None) == dp.is_owner, dp.fqn
        opt.step()
        momentum.append(owner_momentum(model, opt))  # TP-local shards on the DP owners
        sched.step()
        opt.zero_grad()
        ns_calls.append(opt.last_step_stats["ns_calls"])
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / world_size)
    owned = [
        dict(
            name=dp.param_name,
            local=tuple(dp._orig_size),
            full=tuple(dp.full_shape),
            shard_dim=dp.shard_dim,
            is_tp_owner=dp.is_tp_owner,
            tp_group_size=dp.tp_group.size() if dp.tp_group else 1,
        )
        for dp in dmuon.get_owned_params(model, rank=dist.get_rank())
    ]
    return dict(
        losses=losses,
        ns_calls=ns_calls,
        norms=norms,
        momentum=momentum,
        sd=dmuon.get_model_state_dict(model),
        osd=dmuon.get_optimizer_state_dict(model, opt),
        owned=owned,
        tp_rank=st.tp_rank,
        n_dedicated=len(st.dparams),
        ledger=dict(st.ledger.last_step),
        p_tp=sum(dp.numel * dp.tp_group.size() for dp in st.dparams if dp.tp_group is not None),
        tp_paths={m.fqn: d.path for m, d in dmuon.tp_paths(model, opt)},  # what the start-up log prints
    )
