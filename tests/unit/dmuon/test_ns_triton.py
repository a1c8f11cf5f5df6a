"""The Triton kernels for Newton-Schulz's symmetric products (titan_dmuon/dmuon/kernels/) and the kernel
dispatch (ns_ops.py), run on CPU tensors under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when kernels/syrk.py is imported: the `syrk`
fixture (conftest.py) sets it and imports (or re-imports) that module, so these tests run the interpreter
whatever was imported before. They skip, naming the reason, only where Triton does not import.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.ns_reference import reference_ns
from tests.unit.dmuon.helpers import rank8_case
from titan_dmuon.dmuon import ns_ops
from titan_dmuon.dmuon.newton_schulz import get_ns_backend, zeropower_via_newtonschulz


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (n, k) of X (n × k): the tile is 64 under the interpreter, so 150 and 130 are ragged multi-tile cases
SHAPES = {"square": (64, 64), "square-ragged": (150, 150), "tall": (150, 40), "wide": (40, 150), "ragged": (130, 200)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_syrk_against_torch(syrk, shape, dtype):
    x = randn(*shape, seed=1, dtype=dtype)
    got = syrk.sym_matmul(x, out_dtype=torch.float32)
    want = x.double() @ x.double().T  # the same (rounded) operands, exactly
    assert got.shape == (shape[0], shape[0]) and got.dtype == torch.float32
    assert rel(got, want) < 1e-6  # fp32 accumulation of exact products
    assert torch.equal(got, got.T)  # computed on the lower triangle, mirrored
    low = syrk.sym_matmul(x)  # out dtype defaults to the input's
    assert low.dtype == dtype and rel(low, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_syrk_batched_and_strided(syrk, dtype):
    x = randn(3, 200, 70, seed=2, dtype=dtype).mT  # (3, 70, 200), not contiguous
    got = syrk.sym_matmul(x, out_dtype=torch.float32)
    want = x.double() @ x.double().mT
    assert got.shape == (3, 70, 70)
    for i in range(3):
        assert rel(got[i], want[i]) < 1e-6


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (10 mantissa bits), rounded to nearest even, as float64."""
    bits = t.float().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32).double()


ROUND = {
    "bf16": lambda t: t.bfloat16().double(),
    "fp16": lambda t: t.half().double(),
    "tf32": _tf32,
    "ieee": lambda t: t.double(),
}


@pytest.mark.parametrize("precision", list(ROUND))
def test_symmetric_product_at_each_precision(syrk, precision):
    """α·A·B + β·C + γ·I for commuting symmetric fp32 A, B (B a polynomial in A): the operands rounded to the
    precision's grid (to nearest even, as a GPU does), products accumulated in fp32; C's upper triangle is
    never read (garbage there changes nothing); the result is exactly symmetric."""
    n = 150
    a = randn(2, n, 90, seed=3)
    a = (a @ a.mT) / 90
    b = 0.5 * torch.eye(n) + 0.3 * a - 0.2 * (a @ a)
    b = (b + b.mT) / 2  # exactly symmetric, so that rounding keeps it so
    c = randn(2, n, n, seed=4)
    c = c + c.mT
    c_garbage = c + torch.triu(torch.full((n, n), 1e3), diagonal=1)
    got = syrk.sym_matmul(
        a, b, alpha=0.7, beta=-1.5, c=c_garbage, gamma=3.0, out_dtype=torch.float32, precision=precision
    )
    rnd = ROUND[precision]
    full = 0.7 * rnd(a) @ rnd(b) - 1.5 * c.double() + 3.0 * torch.eye(n, dtype=torch.float64)
    # rounded operands commute only to their precision: the kernel's contract is the lower triangle, mirrored
    want = torch.tril(full) + torch.tril(full, -1).mT
    assert rel(got, want) < 1e-6  # a truncating cast would be off by ~1e-4 (fp16) to ~1e-3 (bf16)
    assert rel(got, full) < {"bf16": 2e-4, "fp16": 3e-5, "tf32": 3e-5, "ieee": 1e-6}[precision]
    assert torch.equal(got, got.mT)


def test_full_product(syrk):
    """symmetric=False: every tile, no mirroring (the Gram formulation's Q·A): A·Bᵀ + β·C + γ·I."""
    a, b, c = randn(2, 130, 130, seed=7), randn(2, 130, 130, seed=8), randn(2, 130, 130, seed=9)
    got = syrk.sym_matmul(a, b, beta=0.5, c=c, gamma=2.0, out_dtype=torch.float32, symmetric=False)
    want = a.double() @ b.double().mT + 0.5 * c.double() + 2.0 * torch.eye(130, dtype=torch.float64)
    assert rel(got, want) < 1e-6 and not torch.equal(got, got.mT)


def test_bf16_results_are_rounded_to_nearest(syrk):
    x = randn(100, 50, seed=10)
    got = syrk.sym_matmul(x, out_dtype=torch.bfloat16, precision="ieee")
    assert torch.equal(got, (x.double() @ x.double().T).float().bfloat16())


def test_sym_matmul_errors(syrk):
    with pytest.raises(ValueError, match="one \\(batch, n, k\\) shape"):
        syrk.sym_matmul(torch.randn(4, 6), torch.randn(4, 7))
    with pytest.raises(ValueError, match="C has shape"):
        syrk.sym_matmul(torch.randn(4, 6), c=torch.randn(5, 5), beta=1.0)
    with pytest.raises(ValueError, match="precision"):
        syrk.sym_matmul(torch.randn(4, 6), precision="fp8")
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        syrk.sym_matmul(torch.randn(4, 6, dtype=torch.float64))
    assert syrk.sym_matmul(torch.randn(0, 5, 3)).shape == (0, 5, 5)


@pytest.mark.parametrize("formulation", ["direct", "gram"])
@pytest.mark.parametrize("coefficients", ["polar_express", "muon"])
@pytest.mark.parametrize("shape", [(24, 72), (72, 24), (2, 40, 72)], ids=["wide", "tall", "batch"])
def test_ns_with_triton_against_the_reference(syrk, shape, coefficients, formulation):
    """The whole NS with the Triton kernel against ns_reference.py's fp32 NS (torch.optim.Muon's loop)."""
    G = randn(*shape, seed=5)
    got = zeropower_via_newtonschulz(
        G, coefficients=coefficients, dtype=torch.float32, formulation=formulation, kernel="triton"
    )
    assert got.shape == G.shape and got.dtype == torch.float32
    for g, o in zip(G.reshape(-1, *shape[-2:]), got.reshape(-1, *shape[-2:]), strict=True):
        assert rel(o, reference_ns(g, coefficients, 5, 1e-7, dtype=torch.float32)) < 2e-5


@pytest.mark.parametrize("formulation", ["direct", "gram"])
def test_ns_with_triton_bf16_close_to_torch_bf16(syrk, formulation):
    G = randn(40, 96, seed=6)
    kw = dict(dtype=torch.bfloat16, formulation=formulation)
    got = zeropower_via_newtonschulz(G, kernel="triton", **kw)
    want = zeropower_via_newtonschulz(G, kernel="torch", **kw)
    exact = reference_ns(G.double(), "polar_express", 5, 1e-7, dtype=torch.float64)
    assert got.dtype == torch.bfloat16
    # bf16 rounding (~2e-2 from the exact iteration); Gram's s×s products run on TF32 operands: no worse
    assert rel(got, exact) < 3e-2 and rel(want, exact) < 3e-2


@pytest.mark.slow
def test_triton_bf16_gram_on_the_rank8_gradient(syrk):
    """The issue's 256×1024 case with the Triton kernel (fp32 iterates): near the exact iteration."""
    G = rank8_case()
    exact = reference_ns(G.double(), "polar_express", 5, 1e-7, dtype=torch.float64)
    got = zeropower_via_newtonschulz(G, dtype=torch.bfloat16, formulation="gram", kernel="triton")
    assert abs(got.double().norm() / exact.norm() - 1) < 0.05
    assert rel(got, exact) < 0.35  # bf16 direct: 0.24


# ---- dispatch -------------------------------------------------------------------------------------------------


def test_resolve_kernel(syrk, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ns_ops.ENV_KERNEL, raising=False)
    assert ns_ops.resolve_kernel("auto", cpu, torch.float32) == "torch"  # CPU: never the interpreter by itself
    assert ns_ops.resolve_kernel("torch", cpu, torch.float32) == "torch"
    assert ns_ops.resolve_kernel("triton", cpu, torch.float32) == "triton"  # the interpreter runs it here
    monkeypatch.setenv(ns_ops.ENV_KERNEL, "triton")  # the variable overrides "auto", not an explicit kernel
    assert ns_ops.resolve_kernel("auto", cpu, torch.bfloat16) == "triton"
    assert ns_ops.resolve_kernel("torch", cpu, torch.bfloat16) == "torch"
    assert get_ns_backend(cpu, torch.float32) == "Direct NS · kernel=triton (cpu, float32)"
    monkeypatch.setenv(ns_ops.ENV_KERNEL, "Torch ")
    assert ns_ops.resolve_kernel("auto", cpu, torch.float32) == "torch"
    monkeypatch.setenv(ns_ops.ENV_KERNEL, "cutlass")
    with pytest.raises(ValueError, match="DMUON_NS_KERNEL='cutlass'"):
        ns_ops.resolve_kernel("auto", cpu, torch.float32)
    monkeypatch.delenv(ns_ops.ENV_KERNEL)
    with pytest.raises(ValueError, match="one of"):
        ns_ops.resolve_kernel("cublas", cpu, torch.float32)
    with pytest.raises(RuntimeError, match="bfloat16, float16 or float32"):
        ns_ops.resolve_kernel("triton", cpu, torch.float64)
    monkeypatch.setattr(syrk, "INTERPRETED", False)  # a CPU tensor without the interpreter
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ns_ops.resolve_kernel("triton", cpu, torch.float32)


def test_one_time_check_against_torch(syrk, monkeypatch, caplog):
    """What "auto" runs on CUDA before taking Triton, here on the interpreter: it passes, and a kernel that
    computes something else (or raises) is refused with a warning."""
    check = ns_ops._triton_passes_check.__wrapped__  # the uncached check
    cpu = torch.device("cpu")
    assert check(cpu, torch.float32) and check(cpu, torch.bfloat16)
    real = syrk.sym_matmul
    monkeypatch.setattr(syrk, "sym_matmul", lambda *a, **k: real(*a, **k) * 1.01)
    with caplog.at_level(logging.WARNING, logger="titan_dmuon.dmuon.ns_ops"):
        assert not check(cpu, torch.float32)
    assert "Triton differs from torch" in caplog.text

    def broken(*a, **k):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(syrk, "sym_matmul", broken)
    with caplog.at_level(logging.WARNING, logger="titan_dmuon.dmuon.ns_ops"):
        assert not check(cpu, torch.float32)
    assert "out of resources" in caplog.text
