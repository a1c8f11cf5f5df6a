"""Batched owner Newton-Schulz: a stack equals the matrices one by one, the owner step batches its same-shape
matrices in memory-bounded chunks, and ns_calls still counts matrices."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.ns_reference import reference_ns
from tests.unit.dmuon.helpers import DEDICATED, dedicated, tiny, x
from titan_dmuon import dmuon
from titan_dmuon.dmuon.newton_schulz import batch_plan, orthogonalize_stack, zeropower_via_newtonschulz


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("formulation", ["direct", "gram"])
@pytest.mark.parametrize("coefficients", ["polar_express", "muon"])
@pytest.mark.parametrize("shape", [(24, 56), (56, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_batch_equals_one_by_one_fp32(shape, coefficients, formulation):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(5, *shape, generator=g)
    G[1] *= 1e-3  # per-matrix normalization: scales do not leak across the batch
    kw = dict(coefficients=coefficients, dtype=torch.float32, formulation=formulation)
    batched = zeropower_via_newtonschulz(G, **kw)
    assert batched.shape == G.shape and batched.dtype == torch.float32
    for i in range(len(G)):
        assert rel(batched[i], zeropower_via_newtonschulz(G[i], **kw)) < 1e-6
        assert rel(batched[i], reference_ns(G[i].double(), coefficients, 5, 1e-7, dtype=torch.float64)) < 2e-5


def test_a_batch_of_one_is_the_single_matrix_path_bitwise():
    G = torch.randn(1, 12, 20)
    for form in ("direct", "gram"):
        got = zeropower_via_newtonschulz(G, formulation=form, dtype=torch.bfloat16)
        assert torch.equal(got[0], zeropower_via_newtonschulz(G[0], formulation=form, dtype=torch.bfloat16))


def test_zero_matrix_in_a_batch_stays_zero():
    G = torch.randn(3, 6, 9)
    G[1] = 0
    out = zeropower_via_newtonschulz(G, dtype=torch.float32)
    assert torch.equal(out[1], torch.zeros(6, 9)) and out[0].abs().sum() > 0


def test_orthogonalize_stack_mixes_orientations():
    """Tall matrices are stacked transposed and handed back in their own orientation."""
    g = torch.Generator().manual_seed(1)
    mats = [torch.randn(16, 40, generator=g), torch.randn(40, 16, generator=g), torch.randn(16, 40, generator=g)]
    outs = orthogonalize_stack(mats, dtype=torch.float32, coefficients="muon")
    for m, o in zip(mats, outs, strict=True):
        assert o.shape == m.shape
        assert rel(o, zeropower_via_newtonschulz(m, dtype=torch.float32, coefficients="muon")) < 1e-6
    assert orthogonalize_stack([]) == []
    with pytest.raises(ValueError, match="one shape up to transposition"):
        orthogonalize_stack([torch.randn(4, 6), torch.randn(4, 7)])


def test_batch_plan_groups_by_shape_and_settings_and_bounds_chunks():
    shapes = [(4, 8), (8, 4), (4, 4), (4, 8), (4, 8), (4, 4)]
    assert batch_plan(shapes) == [[0, 1, 3, 4], [2, 5]]
    keys = ["a", "a", "a", "b", "a", "a"]
    assert batch_plan(shapes, keys) == [[0, 1, 4], [2, 5], [3]]
    # at most 2 matrices of 32 elements per chunk, split evenly; one matrix even when it alone is too big
    assert batch_plan(shapes, max_elements=64) == [[0, 1], [3, 4], [2, 5]]
    assert batch_plan(shapes, max_elements=100) == [[0, 1], [3, 4], [2, 5]]
    assert batch_plan([(4, 8)] * 5, max_elements=96) == [[0, 1], [2, 3, 4]]  # 3 per chunk at most: 2 + 3
    assert batch_plan(shapes, max_elements=1) == [[0], [1], [3], [4], [2], [5]]


def _train(model, opt, steps=3):
    for step in range(steps):
        opt.zero_grad()
        model(x(step)).backward()
        opt.step()


def test_owner_step_batches_same_shape_matrices(one_rank, monkeypatch):
    """On one rank the owner holds all six matrices of the tiny model (8×16, 16×8, 16×8 per layer: one shape up
    to transposition): one batched NS call per step, ns_calls = 6; with ns_max_batch_elements=1 they run one by
    one, and the two agree to fp32 rounding."""
    _, model_a = dedicated(tiny())
    _, model_b = dedicated(tiny())
    calls = []
    real = orthogonalize_stack

    def spy(mats, **kw):
        calls.append(len(mats))
        return real(mats, **kw)

    monkeypatch.setattr("titan_dmuon.dmuon.muon.orthogonalize_stack", spy)
    batched = dmuon.Muon(model_a, ns_coefficients="muon", ns_dtype=torch.float32)
    one_by_one = dmuon.Muon(model_b, ns_coefficients="muon", ns_max_batch_elements=1, ns_dtype=torch.float32)
    _train(model_a, batched)
    assert calls == [6, 6, 6]
    assert batched.last_step_stats["ns_calls"] == 6.0 and batched.last_step_stats["ns_time_s"] > 0
    calls.clear()
    _train(model_b, one_by_one)
    assert calls == [1] * 18 and one_by_one.last_step_stats["ns_calls"] == 6.0
    sa, sb = dmuon.get_model_state_dict(model_a), dmuon.get_model_state_dict(model_b)
    for k in DEDICATED:
        assert rel(sa[k], sb[k]) < 1e-6, k


def test_param_groups_with_other_ns_settings_batch_apart(one_rank, monkeypatch):
    _, model = dedicated(tiny())
    calls = []
    real = orthogonalize_stack
    monkeypatch.setattr(
        "titan_dmuon.dmuon.muon.orthogonalize_stack", lambda mats, **kw: calls.append(len(mats)) or real(mats, **kw)
    )
    layer0 = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]
    opt = dmuon.Muon(model, param_groups=[{"params": layer0, "ns_steps": 3}])
    _train(model, opt, steps=1)
    assert sorted(calls) == [3, 3]


def test_ns_options_are_validated(one_rank):
    _, model = dedicated(tiny())
    with pytest.raises(ValueError, match="kernel"):
        dmuon.Muon(model, kernel="cublas")
    with pytest.raises(ValueError, match="ns_formulation"):
        dmuon.Muon(model, ns_formulation="svd")
    with pytest.raises(ValueError, match="ns_max_batch_elements"):
        dmuon.Muon(model, ns_max_batch_elements=0)


def test_gram_formulation_in_the_optimizer(one_rank):
    """ns_formulation="gram" trains like "direct" (fp32 NS: the same iteration, other rounding)."""
    base = tiny()
    _, model_d = dedicated(copy.deepcopy(base))
    _, model_g = dedicated(copy.deepcopy(base))
    _train(model_d, dmuon.Muon(model_d, ns_dtype=torch.float32))
    _train(model_g, dmuon.Muon(model_g, ns_formulation="gram", ns_dtype=torch.float32))
    sd, sg = dmuon.get_model_state_dict(model_d), dmuon.get_model_state_dict(model_g)
    for k in DEDICATED:
        assert rel(sg[k], sd[k]) < 1e-5, k


def test_muon_with_the_triton_kernel(syrk, one_rank):
    """dmuon.Muon(kernel="triton") trains like kernel="torch" (fp32 NS)."""
    base = tiny()
    out = {}
    for kernel in ("torch", "triton"):
        _, model = dedicated(copy.deepcopy(base))
        opt = dmuon.Muon(model, kernel=kernel, ns_formulation="gram", ns_dtype=torch.float32)
        for step in range(2):
            opt.zero_grad()
            model(x(step)).backward()
            opt.step()
        out[kernel] = dmuon.get_model_state_dict(model)
    for k in DEDICATED:
        assert rel(out["triton"][k], out["torch"][k]) < 1e-5, k
