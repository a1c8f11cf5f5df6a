"""The Gram formulation of Newton-Schulz against the direct one and against the independent NS of
tests/ns_reference.py, on hard inputs (ill-conditioned, low-rank plus noise), and the singular-value
band each coefficient set promises.

Bands, measured by composing each step's scalar polynomial σ ← aσ + bσ³ + cσ⁵ over the normalized singular
values (5 steps): Polar Express maps σ ∈ [1e-2, 1/1.01] into [0.870, 1.124] and σ ∈ [1e-3, 1/1.01] into
[0.846, 1.124]; the "muon" quintic maps σ ∈ [1e-2, 1] into [0.682, 1.134] and σ ∈ [1e-3, 1] into [0.471, 1.202].
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.ns_reference import ns_schedule, reference_ns
from tests.unit.dmuon.helpers import matrix, rank8_case
from titan_dmuon.dmuon.newton_schulz import GRAM_RESTART_GAIN, gram_restarts, zeropower_via_newtonschulz

COEFFS = ["polar_express", "muon"]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def composed(sigma: torch.Tensor, coefficients: str, steps: int = 5) -> torch.Tensor:
    """The scalar map NS applies to each normalized singular value (ns_reference.py's schedule)."""
    triples, _ = ns_schedule(coefficients, steps)
    for a, b, c in triples:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


@pytest.mark.parametrize("kind", ["random", "illcond", "lowrank"])
@pytest.mark.parametrize("shape", [(48, 48), (40, 96), (96, 40)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("coefficients", COEFFS)
def test_gram_equals_direct_fp32(kind, shape, coefficients):
    G = matrix(kind, *shape)
    kw = dict(ns_steps=5, coefficients=coefficients, dtype=torch.float32)
    direct = zeropower_via_newtonschulz(G, formulation="direct", **kw)
    gram = zeropower_via_newtonschulz(G, formulation="gram", **kw)
    assert gram.shape == G.shape and gram.dtype == torch.float32
    assert rel(gram, direct) < 1e-4
    exact = reference_ns(G.double(), coefficients, 5, 1e-7, dtype=torch.float64)
    assert rel(gram, exact) < 1e-4


@pytest.mark.parametrize("coefficients", COEFFS)
def test_gram_batch_equals_reference_gram(coefficients):
    """A batch in the Gram formulation: each matrix as ns_reference.py's Gram NS (fp32) computes it."""
    G = torch.stack([matrix(k, 24, 64, seed=i) for i, k in enumerate(["random", "illcond", "lowrank"])])
    got = zeropower_via_newtonschulz(G, coefficients=coefficients, dtype=torch.float32, formulation="gram")
    for g, o in zip(G, got, strict=True):
        want = reference_ns(g.double(), coefficients, 5, 1e-7, dtype=torch.float64, gram=True)
        assert rel(o, want) < 1e-4


def test_gram_restart_schedule():
    """Restart before a step that would take the product of the `a` coefficients since the last restart past
    GRAM_RESTART_GAIN (40): Polar Express a = 8.2, 4.07, 3.91, 3.29, 2.28: (8.2·4.07 = 33.4, then 3.91·3.29·2.28 =
    29.3); the Muon quintic a = 3.4445: two steps (11.9) per segment, a third would be 40.9."""
    assert GRAM_RESTART_GAIN == 40.0
    pe, _ = ns_schedule("polar_express", 5)
    muon, _ = ns_schedule("muon", 5)
    assert gram_restarts(pe) == (2,)
    assert gram_restarts(muon) == (2, 4)
    assert gram_restarts(ns_schedule("polar_express", 8)[0]) == (2, 5)
    assert gram_restarts(muon[:2]) == ()
    assert gram_restarts([(1.5, -0.5, 0.0)] * 9) == (), "a gain of 1.5^9 = 38 never needs a restart"


@pytest.mark.parametrize("coefficients,band", [("polar_express", (0.846, 1.124)), ("muon", (0.471, 1.202))])
@pytest.mark.parametrize("formulation", ["direct", "gram"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_singular_values_in_the_promised_band(coefficients, band, formulation, dtype, tol):
    """Singular values log-spaced over two decades: each output singular value is the composed scalar map of
    its normalized input (to fp32 / bf16 accuracy), and all of them lie in the band the coefficient set
    promises for normalized σ ∈ [1e-3, 1] (module docstring; checked here against the composed map too)."""
    m, n = 32, 80
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    sv = torch.logspace(0, -2, m, dtype=torch.float64)
    G = (u @ torch.diag(sv) @ v.T).float()
    out = zeropower_via_newtonschulz(G, coefficients=coefficients, dtype=dtype, formulation=formulation)
    got = torch.linalg.svdvals(out.double())
    _, cushion = ns_schedule(coefficients, 5)
    sigma = sv / (sv.norm() * cushion)
    assert sigma.min() > 1e-3
    want = composed(sigma, coefficients).sort(descending=True).values
    assert (got - want).abs().max() < tol
    grid = composed(torch.logspace(-3, -math.log10(cushion), 100001, dtype=torch.float64), coefficients)
    assert grid.min() == pytest.approx(band[0], abs=1e-3) and grid.max() == pytest.approx(band[1], abs=1e-3)
    assert band[0] - tol <= got.min() and got.max() <= band[1] + tol


@pytest.mark.parametrize("coefficients", COEFFS)
def test_bf16_gram_stays_near_the_polar_factor_on_a_rank8_gradient(coefficients):
    """Unrestarted bf16 Gram NS (ns_reference.py's, in bf16) blows this case up by orders of magnitude; the
    library's Gram NS (restarts, fp32 iterates) stays as close to the exact iteration and to the true polar
    factor U Vᵀ as bf16 direct NS does."""
    G = rank8_case()
    exact = reference_ns(G.double(), coefficients, 5, 1e-7, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = u @ vh
    naive = reference_ns(G, coefficients, 5, 1e-7, dtype=torch.bfloat16, gram=True)
    assert naive.double().norm() / exact.norm() > 3, "the case must defeat a naive bf16 Gram iteration"
    direct = zeropower_via_newtonschulz(G, coefficients=coefficients, dtype=torch.bfloat16, kernel="torch")
    gram = zeropower_via_newtonschulz(
        G, coefficients=coefficients, dtype=torch.bfloat16, formulation="gram", kernel="torch"
    )
    assert gram.dtype == torch.bfloat16
    for out in (direct, gram):
        assert abs(out.double().norm() / exact.norm() - 1) < 0.05
    assert rel(gram, exact) < 1.25 * rel(direct, exact)
    assert rel(gram, polar) < rel(exact, polar) + 0.05


def test_the_reference_ns_shares_no_code_with_the_library() -> None:
    """ns_reference.py imports nothing from titan_dmuon: a bug in newton_schulz.py cannot hide in its reference."""
    import ast

    from tests import ns_reference

    tree = ast.parse(open(ns_reference.__file__).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0]
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)), "a relative import"
    assert sorted(set(imported)) == ["__future__", "torch"]
