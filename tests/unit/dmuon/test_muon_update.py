"""dmuon.Muon's update rule (docs/dmuon.md, The update) on tiny matrices, one process, against values written
out here: the lr adjustment ("original", the default, and "match_rms_adamw"), EMA momentum with Nesterov on
and off, decoupled weight decay before the orthogonal step, `param_groups` overrides, the shipped defaults,
and the "muon" / "polar_express" coefficient sets against a Newton-Schulz iteration written out below.

The NS runs in float64 (`ns_dtype`); weights and momentum are checked at 1e-5 relative (fp32 masters and
buffers, measured ~2e-6), far below what a wrong rule moves them (1e-3 and more).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tests.ns_reference import MUON_ABC, POLAR_EXPRESS
from titan_dmuon.dmuon.muon import adjusted_lr
from titan_dmuon.dmuon.newton_schulz import zeropower_via_newtonschulz

SHAPES = {"tall": (8, 2), "wide": (3, 12), "square": (4, 4)}
# lr factors written out: "original" sqrt(max(1, rows/cols)), "match_rms_adamw" 0.2·sqrt(max(rows, cols))
ORIGINAL = {"tall": math.sqrt(8 / 2), "wide": 1.0, "square": 1.0}
MATCH_RMS = {"tall": 0.2 * math.sqrt(8), "wide": 0.2 * math.sqrt(12), "square": 0.2 * math.sqrt(4)}


def ns(u: torch.Tensor, coefficients: str, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic X <- aX + (bA + cA²)X, A = XXᵀ, on the short side, after X / max(‖X‖_F·cushion, eps);
    "muon" repeats Keller Jordan's triple (cushion 1), "polar_express" walks its table (cushion 1.01)."""
    if coefficients == "muon":
        triples, cushion = [MUON_ABC] * steps, 1.0
    else:
        triples, cushion = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)], 1.01
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item() * cushion, eps)
    for a, b, c in triples:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


class Mats(nn.Module):
    """Three bias-free Linears (tall, wide, square weights) and a 1D gain for the AdamW half. The loss is
    linear in the weights, so each step's grads are exactly the given matrices."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mats = nn.ModuleDict({k: nn.Linear(c, r, bias=False) for k, (r, c) in SHAPES.items()})
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = (self.gain * grads["gain"]).sum()
        for k, lin in self.mats.items():
            loss = loss + (lin(torch.eye(lin.in_features)) * grads[k].T).sum()  # lin(I) = Wᵀ
        return loss


def grads_for(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}
    out["gain"] = torch.randn(5, generator=g)
    return out


def build(groups=None, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    model = Mats()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (1,)), lambda n, p: n.startswith("mats."))
    init = {k: v.detach().double().clone() for k, v in dmuon.get_model_state_dict(model).items()}
    param_groups = None
    if groups is not None:
        params = dict(model.named_parameters())
        param_groups = [{**g, "params": [params[n] for n in g["params"]]} for g in groups]
    return model, dmuon.Muon(model, param_groups=param_groups, **kwargs), init


def run(model, opt, steps: int):
    """`steps` steps; after each: the full weights and every momentum buffer, by name."""
    from titan_dmuon import dmuon

    names = {p: n for n, p in model.named_parameters()}
    out = []
    for step in range(steps):
        model(grads_for(step)).backward()
        opt.step()
        opt.zero_grad()
        bufs = {names[p]: s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
        out.append((dmuon.get_model_state_dict(model), bufs))
    return out


def expected_muon(w0, name, steps, *, lr, momentum, nesterov, weight_decay, factor, coefficients):
    """torch.optim.Muon's rule written out: buf <- μ·buf + (1-μ)·g; u = (1-μ)·g + μ·buf (Nesterov) or buf;
    W <- W·(1 - lr·wd), then W <- W - lr·factor·NS(u)."""
    w, buf, out = w0.clone(), torch.zeros_like(w0), []
    for step in range(steps):
        g = grads_for(step)[name].double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        w = w * (1 - lr * weight_decay)
        w = w - lr * factor * ns(u, coefficients)
        out.append((w.clone(), buf.clone()))
    return out


def expected_adamw(p0, steps, *, lr, betas, eps, weight_decay):
    """AdamW written out (bias-corrected moments, decoupled weight decay first)."""
    b1, b2 = betas
    p, m, v, out = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), []
    for t in range(1, steps + 1):
        g = grads_for(t - 1)["gain"].double()
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        out.append(p.clone())
    return out


def assert_close(got, want, what, rtol=1e-5):
    err = (got.double() - want.double()).norm().item()
    assert err <= rtol * want.double().norm().item(), f"{what}: relative error {err / want.norm().item():.2e}"


# ----------------------------------------------------------------------------------------------------------
# lr adjustment


@pytest.mark.parametrize("kind", list(SHAPES))
def test_adjusted_lr_known_values(kind):
    shape = SHAPES[kind]
    assert adjusted_lr(0.1, "original", shape) == pytest.approx(0.1 * ORIGINAL[kind], rel=1e-15)
    assert adjusted_lr(0.1, None, shape) == pytest.approx(0.1 * ORIGINAL[kind], rel=1e-15)
    assert adjusted_lr(0.1, "match_rms_adamw", shape) == pytest.approx(0.1 * MATCH_RMS[kind], rel=1e-15)


def test_adjusted_lr_more_known_values_and_errors():
    assert adjusted_lr(1.0, "match_rms_adamw", (4096, 1024)) == pytest.approx(0.2 * 64, rel=1e-15)
    assert adjusted_lr(1.0, "match_rms_adamw", (1024, 4096)) == pytest.approx(0.2 * 64, rel=1e-15)
    assert adjusted_lr(1.0, "original", (4096, 1024)) == pytest.approx(2.0, rel=1e-15)
    assert adjusted_lr(1.0, "original", (1024, 4096)) == 1.0
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr(1.0, "min", (4, 4))


# ----------------------------------------------------------------------------------------------------------
# Newton-Schulz coefficient sets


@pytest.mark.parametrize("steps", [1, 5, 10])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_coefficient_sets_match_written_out_iteration(kind, steps):
    g = torch.Generator().manual_seed(7)
    G = torch.randn(*SHAPES[kind], generator=g, dtype=torch.float64)
    got = {}
    for coeffs in ("muon", "polar_express"):
        got[coeffs] = zeropower_via_newtonschulz(G, ns_steps=steps, coefficients=coeffs, dtype=torch.float64)
        want = ns(G, coeffs, steps)
        assert (got[coeffs] - want).norm() <= 1e-12 * want.norm(), coeffs
    # the two sets give different results: swapping them (or the cushion) is visible
    assert (got["muon"] - got["polar_express"]).norm() > 1e-2 * got["muon"].norm()


# ----------------------------------------------------------------------------------------------------------
# the step


CASES = {
    "nesterov-match_rms-polar": dict(nesterov=True, adjust_lr_fn="match_rms_adamw", ns_coefficients="polar_express"),
    "plain-original-muon": dict(nesterov=False, adjust_lr_fn="original", ns_coefficients="muon"),
    "nesterov-original-muon": dict(nesterov=True, adjust_lr_fn="original", ns_coefficients="muon"),
    "plain-match_rms-polar": dict(nesterov=False, adjust_lr_fn="match_rms_adamw", ns_coefficients="polar_express"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_hand_computed(one_rank, case):
    """Three steps with different grads (one step cannot tell Nesterov from plain momentum: both feed NS a
    multiple of g) and a weight decay large enough that applying it after the update is visible."""
    opts = CASES[case]
    lr, mu, wd = 0.1, 0.9, 0.5
    model, opt, init = build(lr=lr, momentum=mu, weight_decay=wd, ns_dtype=torch.float64, **opts)
    got = run(model, opt, 3)
    factors = MATCH_RMS if opts["adjust_lr_fn"] == "match_rms_adamw" else ORIGINAL
    for kind in SHAPES:
        name = f"mats.{kind}.weight"
        want = expected_muon(
            init[name],
            kind,
            3,
            lr=lr,
            momentum=mu,
            nesterov=opts["nesterov"],
            weight_decay=wd,
            factor=factors[kind],
            coefficients=opts["ns_coefficients"],
        )
        for step, ((sd, bufs), (w, buf)) in enumerate(zip(got, want, strict=True)):
            assert_close(bufs[name], buf, f"{name} momentum, step {step}")
            assert_close(sd[name], w, f"{name} weight, step {step}")


def test_nesterov_and_plain_momentum_differ(one_rank):
    """The check above is not vacuous: from step 2 on, Nesterov and plain momentum move the weights apart
    by far more than its tolerance."""
    runs = {}
    for nesterov in (True, False):
        model, opt, _ = build(lr=0.1, momentum=0.9, nesterov=nesterov, ns_dtype=torch.float64)
        runs[nesterov] = run(model, opt, 2)
    for kind in SHAPES:
        name = f"mats.{kind}.weight"
        a, b = runs[True][1][0][name], runs[False][1][0][name]
        assert (a - b).norm() > 1e-3 * b.norm(), name


def test_shipped_defaults(one_rank):
    """dmuon.Muon(model) with nothing else takes torch.optim.Muon's defaults: lr 1e-3, momentum 0.95, Nesterov,
    weight decay 0.1, Keller Jordan's coefficients ("muon"), the "original" lr adjustment sqrt(max(1, rows/cols));
    AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 (torch.optim.AdamW's)."""
    model, opt, init = build(ns_dtype=torch.float64)
    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert len(muon) == 1
    keys = ("lr", "momentum", "nesterov", "weight_decay", "ns_coefficients", "adjust_lr_fn")
    assert {k: muon[0][k] for k in keys} == dict(
        lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.1, ns_coefficients="muon", adjust_lr_fn="original"
    )
    got = run(model, opt, 2)
    for kind in SHAPES:
        name = f"mats.{kind}.weight"
        want = expected_muon(
            init[name],
            kind,
            2,
            lr=1e-3,
            momentum=0.95,
            nesterov=True,
            weight_decay=0.1,
            factor=ORIGINAL[kind],
            coefficients="muon",
        )
        for step in range(2):
            assert_close(got[step][0][name], want[step][0], f"{name} step {step}")
    want_gain = expected_adamw(init["gain"], 2, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(2):
        assert_close(got[step][0]["gain"], want_gain[step], f"gain step {step}")


def test_default_ns_dtype_on_cpu_is_close(one_rank, native_bf16):
    """Without `ns_dtype` (the device's default: bf16 NS on a CPU with native bf16 matmuls, fp32 on one without) the
    same step agrees to that dtype's precision (fp32: 1e-5; bf16: its NS moves the update by ~1e-2), and the bf16
    default really ran in bf16 (the step is then farther than fp32 rounding from the exact one)."""
    model, opt, init = build(lr=0.1, momentum=0.9, weight_decay=0.5, adjust_lr_fn="match_rms_adamw")
    got = run(model, opt, 2)
    for kind in SHAPES:
        name = f"mats.{kind}.weight"
        want = expected_muon(
            init[name],
            kind,
            2,
            lr=0.1,
            momentum=0.9,
            nesterov=True,
            weight_decay=0.5,
            factor=MATCH_RMS[kind],
            coefficients="muon",
        )
        assert_close(got[1][0][name], want[1][0], name, rtol=5e-2 if native_bf16 else 1e-5)
        err = ((got[1][0][name].double() - want[1][0].double()).norm() / want[1][0].double().norm()).item()
        assert (err > 1e-4) is native_bf16, f"{name}: relative error {err:.2e} with native_bf16={native_bf16}"


def test_param_groups_overrides(one_rank):
    """Per-group overrides, each key of its own kind: the tall matrix gets its own lr, momentum, Nesterov,
    weight decay, lr adjustment and coefficients; the gain (AdamW) its own lr and weight decay; the others
    keep the defaults. A key of the other kind (`betas` on a Muon group) is ignored."""
    defaults = dict(
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.5,
        adjust_lr_fn="match_rms_adamw",
        ns_coefficients="polar_express",
        adamw_lr=1e-2,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
        adamw_weight_decay=0.1,
    )
    tall = dict(
        lr=0.05,
        momentum=0.5,
        nesterov=False,
        weight_decay=0.2,
        adjust_lr_fn="original",
        ns_coefficients="muon",
        betas=(0.0, 0.0),
    )
    groups = [{"params": ["mats.tall.weight"], **tall}, {"params": ["gain"], "lr": 3e-2, "weight_decay": 0.0}]
    model, opt, init = build(groups=groups, ns_dtype=torch.float64, **defaults)
    got = run(model, opt, 3)
    want = {
        "tall": expected_muon(
            init["mats.tall.weight"],
            "tall",
            3,
            lr=0.05,
            momentum=0.5,
            nesterov=False,
            weight_decay=0.2,
            factor=ORIGINAL["tall"],
            coefficients="muon",
        )
    }
    for kind in ("wide", "square"):
        want[kind] = expected_muon(
            init[f"mats.{kind}.weight"],
            kind,
            3,
            lr=0.1,
            momentum=0.9,
            nesterov=True,
            weight_decay=0.5,
            factor=MATCH_RMS[kind],
            coefficients="polar_express",
        )
    want_gain = expected_adamw(init["gain"], 3, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for step in range(3):
        sd, bufs = got[step]
        for kind, w in want.items():
            name = f"mats.{kind}.weight"
            assert_close(bufs[name], w[step][1], f"{name} momentum, step {step}")
            assert_close(sd[name], w[step][0], f"{name} weight, step {step}")
        assert_close(sd["gain"], want_gain[step], f"gain, step {step}")
