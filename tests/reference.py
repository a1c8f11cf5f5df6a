"""Single-process reference: torch.optim.Muon (its NS swapped to the same iteration in fp32) + AdamW."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.optim._muon as torch_muon

from titan_dmuon.dmuon.newton_schulz import zeropower_via_newtonschulz

MUON_ABC = (3.4445, -4.775, 2.0315)


def _ns_fp32(grad, ns_coefficients, ns_steps, eps):
    return zeropower_via_newtonschulz(
        grad, ns_steps=ns_steps, coefficients=ns_coefficients, eps=eps, dtype=torch.float32
    )


def _ns_fp32_gram_rectangular(grad, ns_coefficients, ns_steps, eps):
    formulation = "gram" if grad.size(0) != grad.size(1) else "direct"
    return zeropower_via_newtonschulz(
        grad, ns_steps=ns_steps, coefficients=ns_coefficients, eps=eps, dtype=torch.float32, formulation=formulation
    )


@contextlib.contextmanager
def fp32_torch_muon(gram_for_rectangular: bool = False):
    """torch.optim.Muon with its NS in fp32 (optionally the Gram formulation for non-square matrices,
    which is what DMuon's TP distributed Gram computes)."""
    fn = _ns_fp32_gram_rectangular if gram_for_rectangular else _ns_fp32
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fn):
        yield


def reference_optimizers(
    model, predicate, *, lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, nesterov=True
):
    muon_params = [p for n, p in model.named_parameters() if predicate(n, p)]
    ids = {id(p) for p in muon_params}
    other = [p for p in model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(
        muon_params,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        ns_coefficients=MUON_ABC,
        adjust_lr_fn="original",
    )
    adamw = torch.optim.AdamW(other, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
    return muon, adamw


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Norm-wise relative error: ||actual - expected|| <= rtol·||expected|| (elementwise rtol is
    meaningless for the near-zero entries of a weight matrix)."""
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).norm().item()
    scale = expected.norm().item()
    assert err <= rtol * max(scale, 1e-12), f"{what}: relative error {err / max(scale, 1e-12):.3e} > {rtol:g}"
