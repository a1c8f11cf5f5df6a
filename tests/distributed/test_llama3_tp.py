"""TP-applied Llama-3 (2 real gloo ranks, loss parallel) matches the single-process model: logits, loss and grads."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from titan_dmuon.models.llama3 import apply_tp, build_model

pytestmark = pytest.mark.slow


def _tiny(n_kv_heads: int):
    torch.manual_seed(0)
    return build_model(
        "debugmodel",
        vocab_size=64,
        device="cpu",
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        multiple_of=16,
        max_seq_len=16,
    )


def _loss_and_grads(model, tokens, labels):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(tokens)
    if isinstance(logits, DTensor):  # apply_tp's default loss parallel: logits sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        logits, loss = logits.full_tensor(), loss.full_tensor()
    else:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return logits.detach(), loss.detach(), grads


def _tp_worker(rank: int, world_size: int, sequence_parallel: bool, mesh_2d: bool) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    ref = _tiny(n_kv_heads=2)
    tp_model = copy.deepcopy(ref)
    if mesh_2d:
        tp_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))["tp"]
    else:
        tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    apply_tp(tp_model, tp_mesh, sequence_parallel=sequence_parallel)
    assert tp_model.layers["0"].attention.wq.weight.to_local().shape[0] == 32 // world_size

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    labels = torch.randint(0, 64, (2, 8), generator=g)
    ref_logits, ref_loss, ref_grads = _loss_and_grads(ref, tokens, labels)
    tp_logits, tp_loss, tp_grads = _loss_and_grads(tp_model, tokens, labels)

    torch.testing.assert_close(tp_logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tp_loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert tp_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(tp_grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    return tp_loss.item()


def _both_plans(rank: int, world_size: int) -> list[float]:
    # One spawn for both plans: process start-up dominates this test's time.
    return [_tp_worker(rank, world_size, True, False), _tp_worker(rank, world_size, False, True)]


def test_tp_matches_single_process() -> None:
    """Sequence-parallel plan on a ("tp",) mesh and the plain plan on a 1x2 ("dp", "tp") mesh."""
    losses = run_distributed(_both_plans, 2)
    assert losses[0] == losses[1]


def test_tp_rejects_indivisible_heads() -> None:
    from unittest import mock

    model = build_model("debugmodel", vocab_size=64, dim=48, n_layers=1, n_heads=3)
    mesh = mock.Mock()
    mesh.size.return_value = 2
    with pytest.raises(ValueError, match="n_heads \\(3\\) must be divisible"):
        apply_tp(model, mesh)
