"""Newton-Schulz orthogonalization (titan_dmuon.dmuon.newton_schulz) against references."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.ns_reference import MUON_ABC, POLAR_EXPRESS
from titan_dmuon.dmuon.newton_schulz import (
    MUON_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    default_ns_dtype,
    get_ns_backend,
    ns_flops,
    resolve_coefficients,
    zeropower_via_newtonschulz,
)

MUON, PE = MUON_ABC, POLAR_EXPRESS  # the independent reference's published tables (tests/ns_reference.py)


def torch_muon_ns_reference(grad, ns_coefficients, ns_steps, eps, dtype=torch.float64):
    """torch.optim._muon._zeropower_via_newtonschulz (torch 2.13), copied verbatim except that it computes
    in `dtype` (float64 by default) instead of bf16."""
    a, b, c = ns_coefficients
    ortho_grad = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def polar_express_reference(G, steps, dtype=torch.float64):
    """The Polar Express reference loop (normalize with a 1.01 cushion, then one triple per step)."""
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() * 1.01).clamp(min=1e-7)
    hs = PE[:steps] + [PE[-1]] * max(0, steps - len(PE))
    for a, b, c in hs:
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if G.size(0) > G.size(1) else X


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


SHAPES = [(48, 48), (24, 80), (80, 24)]  # square, wide, tall
SHAPE_IDS = ["square", "wide", "tall"]


# ----------------------------------------------------------------------------------------------------------
# agreement with torch.optim.Muon's algorithm


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_torch_muon_algorithm_float64(shape):
    G = randn(*shape, seed=1, dtype=torch.float64)
    want = torch_muon_ns_reference(G, MUON, 5, 1e-7)
    got = zeropower_via_newtonschulz(G, ns_steps=5, coefficients=MUON, eps=1e-7, dtype=torch.float64)
    assert got.shape == G.shape and got.dtype == torch.float64
    assert rel(got, want) < 1e-12


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_torch_muon_algorithm_float32(shape):
    G = randn(*shape, seed=2)
    want64 = torch_muon_ns_reference(G, MUON, 5, 1e-7)
    want32 = torch_muon_ns_reference(G, MUON, 5, 1e-7, dtype=torch.float32)
    got = zeropower_via_newtonschulz(G, ns_steps=5, coefficients=MUON, eps=1e-7, dtype=torch.float32)
    assert got.shape == G.shape and got.dtype == torch.float32
    assert rel(got, want32) < 1e-6  # same ops in the same precision
    assert rel(got, want64) < 2e-5  # fp32 rounding only (measured ~1e-6)
    # a wrong answer would not be close: the result is far from the (normalized) input
    assert rel(want64, G / G.norm()) > 0.5


def test_bf16_is_bitwise_torch_muon():
    # in bf16 (torch's own precision) the iteration is the same sequence of ops as torch.optim's
    G = randn(40, 72, seed=3)
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    want = torch_ns(G, MUON, 5, 1e-7)
    got = zeropower_via_newtonschulz(G, ns_steps=5, coefficients=MUON, eps=1e-7, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_muon_name_is_repeated_triple(steps):
    G = randn(32, 56, seed=4, dtype=torch.float64)
    want = torch_muon_ns_reference(G, MUON, steps, 1e-7)
    got = zeropower_via_newtonschulz(G, ns_steps=steps, coefficients="muon", dtype=torch.float64)
    assert rel(got, want) < 1e-12
    assert resolve_coefficients("muon", steps) == [MUON] * steps
    assert MUON_COEFFICIENTS == MUON


def test_eps_clamps_zero_input():
    Z = torch.zeros(6, 9, dtype=torch.float64)
    out = zeropower_via_newtonschulz(Z, ns_steps=5, coefficients="muon", dtype=torch.float64)
    assert torch.equal(out, Z)
    # tiny input: the clamp divides by eps, not by the (smaller) norm
    T = torch.full((4, 4), 1e-12, dtype=torch.float64)
    got = zeropower_via_newtonschulz(T, ns_steps=1, coefficients="muon", eps=1e-7, dtype=torch.float64)
    want = torch_muon_ns_reference(T, MUON, 1, 1e-7)
    assert rel(got, want) < 1e-12
    assert got.abs().max().item() == pytest.approx(3.4445 * 1e-5, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# gram formulation


@pytest.mark.parametrize("shape", SHAPES + [(16, 200)], ids=SHAPE_IDS + ["very-wide"])
@pytest.mark.parametrize("coeffs", ["muon", "polar_express"])
def test_gram_equals_direct_float64(shape, coeffs):
    G = randn(*shape, seed=5, dtype=torch.float64)
    d = zeropower_via_newtonschulz(G, ns_steps=5, coefficients=coeffs, dtype=torch.float64, formulation="direct")
    g = zeropower_via_newtonschulz(G, ns_steps=5, coefficients=coeffs, dtype=torch.float64, formulation="gram")
    assert g.shape == G.shape and g.dtype == torch.float64
    assert rel(g, d) < 1e-10


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gram_equals_direct_float32(shape):
    G = randn(*shape, seed=6)
    ref = zeropower_via_newtonschulz(G, ns_steps=5, coefficients="muon", dtype=torch.float64)
    d = zeropower_via_newtonschulz(G, ns_steps=5, coefficients="muon", dtype=torch.float32, formulation="direct")
    g = zeropower_via_newtonschulz(G, ns_steps=5, coefficients="muon", dtype=torch.float32, formulation="gram")
    assert g.dtype == torch.float32
    assert rel(g, d) < 1e-4
    assert rel(g, ref) < 1e-4


# ----------------------------------------------------------------------------------------------------------
# polar express


def _assert_triples(got, want, rel=1e-15):
    """Each coefficient of each triple to `rel` (pytest 9's approx takes no nested sequences)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) == 3
        for a, b in zip(g, w, strict=True):
            assert math.isclose(a, b, rel_tol=rel, abs_tol=0.0), (g, w)


def test_polar_express_table():
    _assert_triples(POLAR_EXPRESS_COEFFICIENTS, PE)
    _assert_triples(resolve_coefficients("polar_express", 5), PE[:5])
    assert len(resolve_coefficients("polar_express", 1)) == 1
    # more steps than the table: the last triple repeats
    r = resolve_coefficients("polar_express", 11)
    _assert_triples(r[:8], PE)
    assert r[8:] == [PE[-1]] * 3 == [(1.875, -1.25, 0.375)] * 3


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (64, 64)], ids=["wide", "tall", "square"])
def test_polar_express_orthogonalizes(shape):
    G = randn(*shape, seed=7)
    out = zeropower_via_newtonschulz(G, ns_steps=5, coefficients="polar_express", dtype=torch.float32)
    sv = torch.linalg.svdvals(out.double())
    sv_in = torch.linalg.svdvals(G.double())
    if shape[0] != shape[1]:
        # well-conditioned rectangular Gaussian: every singular value is pushed near 1
        assert sv.min().item() >= 0.7 and sv.max().item() <= 1.2, sv
    else:
        # square Gaussian has some tiny singular values; the ones not too small relative to the top are near 1
        keep = sv_in / sv_in.max() > 0.05
        assert keep.sum() > shape[0] // 2
        assert sv[keep].min().item() >= 0.7 and sv.max().item() <= 1.2, sv
    # and the singular vectors are preserved: out ≈ U f(S) Vᵀ has the same left/right spaces as G
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    f = torch.diagonal(U.T @ out.double() @ Vh.T)
    assert torch.allclose(U @ torch.diag(f) @ Vh, out.double(), atol=1e-4)


@pytest.mark.parametrize("steps", [3, 5, 10])
@pytest.mark.parametrize("shape", [(30, 50), (50, 30)], ids=["wide", "tall"])
def test_polar_express_matches_reference_loop(shape, steps):
    G = randn(*shape, seed=8, dtype=torch.float64)
    got = zeropower_via_newtonschulz(G, ns_steps=steps, coefficients="polar_express", dtype=torch.float64)
    assert rel(got, polar_express_reference(G, steps)) < 1e-12


def test_polar_express_beats_muon_on_spread():
    # Polar Express converges harder than the Muon quintic: singular values of the result are tighter
    G = randn(64, 160, seed=9)
    pe = torch.linalg.svdvals(zeropower_via_newtonschulz(G, ns_steps=5, coefficients="polar_express").double())
    mu = torch.linalg.svdvals(zeropower_via_newtonschulz(G, ns_steps=5, coefficients="muon").double())
    assert (pe - 1).abs().max() < (mu - 1).abs().max()


# ----------------------------------------------------------------------------------------------------------
# coefficient resolution


def test_single_triple_repeats():
    t = (3.0, -3.2, 1.2)
    assert resolve_coefficients(t, 4) == [t] * 4
    assert resolve_coefficients([3, -3, 1], 2) == [(3.0, -3.0, 1.0)] * 2
    G = randn(20, 36, seed=10, dtype=torch.float64)
    got = zeropower_via_newtonschulz(G, ns_steps=4, coefficients=t, dtype=torch.float64)
    assert rel(got, torch_muon_ns_reference(G, t, 4, 1e-7)) < 1e-12


def test_list_of_triples_truncates_and_repeats_last():
    t1, t2 = (3.0, -3.2, 1.2), (2.0, -1.5, 0.5)
    assert resolve_coefficients([t1, t2], 4) == [t1, t2, t2, t2]
    assert resolve_coefficients([t1, t2, t1, t2], 2) == [t1, t2]
    # a list of 3 triples is a list, not one triple
    assert resolve_coefficients([t1, t2, t1], 3) == [t1, t2, t1]
    # the list form runs exactly those triples in order
    G = randn(12, 20, seed=11, dtype=torch.float64)
    got = zeropower_via_newtonschulz(G, ns_steps=3, coefficients=[t1, t2], dtype=torch.float64)
    X = G.clone()
    X = X / X.norm()
    for a, b, c in [t1, t2, t2]:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    assert rel(got, X) < 1e-12
    # and the order matters (t2 first would give a different result)
    assert rel(zeropower_via_newtonschulz(G, ns_steps=3, coefficients=[t2, t1], dtype=torch.float64), X) > 1e-3


@pytest.mark.parametrize("steps", [0, -1, 100, 1000])
def test_bad_ns_steps(steps):
    with pytest.raises(ValueError):
        resolve_coefficients("muon", steps)
    with pytest.raises(ValueError):
        zeropower_via_newtonschulz(torch.randn(4, 4), ns_steps=steps, coefficients="muon")


def test_ns_steps_bounds_accepted():
    assert len(resolve_coefficients("muon", 1)) == 1
    assert len(resolve_coefficients("muon", 99)) == 99


def test_errors():
    with pytest.raises(ValueError, match="2D"):
        zeropower_via_newtonschulz(torch.randn(5), ns_steps=5)
    with pytest.raises(ValueError, match="batch"):
        zeropower_via_newtonschulz(torch.randn(2, 2, 3, 4), ns_steps=5)
    with pytest.raises(ValueError, match="reduce_gram"):  # the distributed Gram takes one block, Gram formulation
        zeropower_via_newtonschulz(torch.randn(4, 6), reduce_gram=lambda g: g)
    with pytest.raises(ValueError, match="reduce_gram"):
        zeropower_via_newtonschulz(torch.randn(2, 4, 6), formulation="gram", reduce_gram=lambda g: g)
    with pytest.raises(ValueError, match="nope"):
        zeropower_via_newtonschulz(torch.randn(4, 6), ns_steps=5, coefficients="nope")
    with pytest.raises(ValueError):
        resolve_coefficients("Muon", 5)
    with pytest.raises(ValueError):
        resolve_coefficients([(1.0, 2.0), (3.0, 4.0)], 5)
    with pytest.raises(ValueError, match="formulation"):
        zeropower_via_newtonschulz(torch.randn(4, 6), ns_steps=5, formulation="svd")


# ----------------------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("formulation", ["direct", "gram"])
def test_output_dtype_is_requested(dtype, formulation):
    for G in (randn(8, 12, seed=12), randn(12, 8, seed=12, dtype=torch.float64)):
        out = zeropower_via_newtonschulz(G, ns_steps=2, dtype=dtype, formulation=formulation)
        assert out.dtype == dtype and out.shape == G.shape


def test_default_dtype_is_the_devices(native_bf16):
    """bf16 on CUDA and on a CPU with native bf16 matmuls, fp32 on any other CPU; NS without `dtype` runs in it."""
    from titan_dmuon.dmuon.newton_schulz import cpu_has_native_bf16

    assert cpu_has_native_bf16() is native_bf16
    cpu = torch.bfloat16 if native_bf16 else torch.float32
    assert default_ns_dtype(torch.device("cpu")) == cpu
    assert default_ns_dtype("cpu") == cpu
    assert default_ns_dtype(torch.device("cuda", 0)) == torch.bfloat16
    G = randn(10, 14, seed=13, dtype=torch.float64)
    out = zeropower_via_newtonschulz(G, ns_steps=5, coefficients="muon")
    assert out.dtype == cpu
    want = zeropower_via_newtonschulz(G.to(cpu), ns_steps=5, coefficients="muon", dtype=cpu)
    assert torch.equal(out, want)
    out = zeropower_via_newtonschulz(G.bfloat16(), ns_steps=5, coefficients="muon")
    assert out.dtype == cpu  # the device's dtype, not the input's


def test_native_bf16_is_the_cpus_unless_forced(monkeypatch):
    """Unset, the answer is the CPU's own (oneDNN's check); "1"/"0" force it; anything else is an error naming the
    variable, not a silent default."""
    from titan_dmuon.dmuon import newton_schulz

    monkeypatch.delenv(newton_schulz.ENV_NATIVE_BF16, raising=False)
    want = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert newton_schulz.cpu_has_native_bf16() is want
    for value, forced in (("1", True), ("0", False), (" 1 ", True)):
        monkeypatch.setenv(newton_schulz.ENV_NATIVE_BF16, value)
        assert newton_schulz.cpu_has_native_bf16() is forced
    monkeypatch.setenv(newton_schulz.ENV_NATIVE_BF16, "yes")
    with pytest.raises(ValueError, match="DMUON_CPU_NATIVE_BF16='yes'"):
        newton_schulz.default_ns_dtype("cpu")


def test_input_not_modified():
    G = randn(9, 5, seed=14)
    G0 = G.clone()
    zeropower_via_newtonschulz(G, ns_steps=5, dtype=torch.float32)
    zeropower_via_newtonschulz(G, ns_steps=5, dtype=torch.float32, formulation="gram")
    assert torch.equal(G, G0)


# ----------------------------------------------------------------------------------------------------------
# flops


@pytest.mark.parametrize("shape,steps", [((4, 10), 5), ((10, 4), 5), ((7, 7), 3), ((64, 256), 1)])
def test_ns_flops_formula(shape, steps):
    s, long = sorted(shape)
    assert ns_flops(shape, steps) == 2.0 * steps * (2 * s * s * long + s**3)


@pytest.mark.parametrize("shape,steps", [((16, 48), 5), ((48, 16), 3), ((24, 24), 2)])
def test_ns_flops_matches_counted_matmul_flops(shape, steps):
    G = randn(*shape, seed=15)
    with FlopCounterMode(display=False) as fc:
        zeropower_via_newtonschulz(G, ns_steps=steps, coefficients="muon", dtype=torch.float32)
    assert fc.get_total_flops() == ns_flops(shape, steps)


def test_ns_cost_is_half_ns_flops():
    from titan_dmuon.dmuon.partition import ns_cost

    for shape in [(4096, 14336), (1024, 4096), (33, 7)]:
        assert ns_flops(shape, 5) == 2 * ns_cost(shape, 5)


def test_get_ns_backend(monkeypatch, native_bf16):
    """Names the formulation, the kernel that will actually run and the NS dtype, on either kind of host."""
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    cpu_dtype = "bfloat16" if native_bf16 else "float32"
    if not torch.cuda.is_available():
        assert get_ns_backend() == f"Direct NS · kernel=torch (cpu, {cpu_dtype})"
        assert get_ns_backend("cpu", torch.bfloat16, formulation="gram") == "Gram NS · kernel=torch (cpu, bfloat16)"
        assert get_ns_backend("cpu", torch.float32) == "Direct NS · kernel=torch (cpu, float32)"
    else:
        major, minor = torch.cuda.get_device_capability()
        b = get_ns_backend(formulation="gram")
        assert b.startswith("Gram NS · kernel=") and b.endswith(f"(sm{major}{minor}, bfloat16)"), b
    assert get_ns_backend("cpu", kernel="torch") == f"Direct NS · kernel=torch (cpu, {cpu_dtype})"
    with pytest.raises(ValueError, match="formulation"):
        get_ns_backend(formulation="svd")
    with pytest.raises(ValueError, match="kernel"):
        get_ns_backend(kernel="cublas")
