"""Single-process reference: torch.optim.Muon (its bf16 NS swapped for the same iteration in fp32) + AdamW.

Nothing here uses the code under test: the Newton-Schulz iteration is torch.optim.Muon's own, written out in
fp32 (tests/ns_reference.py, plus the Polar Express coefficient table as published, a module that
imports nothing from titan_dmuon), so a bug in titan_dmuon cannot hide in its own reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch
import torch.optim._muon as torch_muon

from tests.ns_reference import MUON_ABC, reference_ns

MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_coefficients", "eps", "adjust_lr_fn")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def _ns_for_torch(grad, ns_coefficients, ns_steps, eps, gram_for_rectangular: bool = False):
    gram = gram_for_rectangular and grad.size(0) != grad.size(1)
    return reference_ns(grad, ns_coefficients, ns_steps, eps, dtype=torch.float32, gram=gram)


@contextlib.contextmanager
def fp32_torch_muon(gram_for_rectangular: bool = False):
    """torch.optim.Muon with its NS in fp32 (optionally the Gram formulation for non-square matrices, which
    is what DMuon's TP distributed Gram computes). Its `ns_coefficients` may then also be "muon" or
    "polar_express"."""
    fn = functools.partial(_ns_for_torch, gram_for_rectangular=gram_for_rectangular)
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fn):
        yield


def match_groups(named_params, groups: Sequence[dict[str, Any]]) -> list[list[torch.nn.Parameter]]:
    """The params of each `{"match": substring, **overrides}` group, by name; each param in at most one."""
    out: list[list[torch.nn.Parameter]] = [[] for _ in groups]
    for name, p in named_params:
        hits = [i for i, g in enumerate(groups) if g["match"] in name]
        assert len(hits) <= 1, f"{name} matches more than one param group"
        if hits:
            out[hits[0]].append(p)
    return out


def reference_optimizers(
    model,
    predicate,
    *,
    lr,
    momentum,
    weight_decay,
    adamw_lr,
    adamw_betas,
    adamw_eps,
    adamw_weight_decay,
    nesterov=True,
    adjust_lr_fn="original",
    ns_coefficients=MUON_ABC,
    ns_steps=5,
    groups: Sequence[dict[str, Any]] = (),
):
    """torch.optim.Muon on the `predicate` matrices, torch.optim.AdamW on the rest. `groups` are per-group
    overrides `{"match": name substring, key: value, ...}`: the matched params get a param group of their
    own with the keys of their optimizer (`lr`, `weight_decay`, ... as dmuon.Muon's `param_groups`)."""
    named = list(model.named_parameters())
    muon_named = [(n, p) for n, p in named if predicate(n, p)]
    ids = {id(p) for _, p in muon_named}
    adamw_named = [(n, p) for n, p in named if id(p) not in ids]

    def param_groups(named_params, keys):
        matched = match_groups(named_params, groups)
        taken = {id(p) for ps in matched for p in ps}
        out = [{"params": [p for _, p in named_params if id(p) not in taken]}]
        for g, ps in zip(groups, matched, strict=True):
            if ps:
                out.append({"params": ps, **{k: v for k, v in g.items() if k in keys}})
        return [g for g in out if g["params"]]

    muon = torch.optim.Muon(
        param_groups(muon_named, MUON_KEYS),
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        ns_coefficients=ns_coefficients,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(
        param_groups(adamw_named, ADAMW_KEYS),
        lr=adamw_lr,
        betas=adamw_betas,
        eps=adamw_eps,
        weight_decay=adamw_weight_decay,
    )
    return muon, adamw


def momentum_buffers(model, muon) -> dict[str, torch.Tensor]:
    """torch.optim.Muon's momentum buffers by parameter name (copies)."""
    return {n: muon.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters() if p in muon.state}


def grad_norm(model) -> float:
    """The global L2 grad norm of every param (the reference side of dmuon.clip_grad_norm_)."""
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Norm-wise relative error: ||actual - expected|| <= rtol·||expected|| (elementwise rtol is
    meaningless for the near-zero entries of a weight matrix)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).norm().item()
    scale = expected.norm().item()
    assert err <= rtol * max(scale, 1e-12), f"{what}: relative error {err / max(scale, 1e-12):.3e} > {rtol:g}"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


class ExpertSlices:
    """An MoE reference's expert stacks (experts x out x in) as torch.optim.Muon sees what DMuon computes: each
    expert's matrix a parameter of its own. `params` go to the optimizer; `take_grads()` after the backwards moves
    each stack's grad onto its slices, `write_back()` after the step puts the slices back into the stacks."""

    def __init__(self, named_params: dict[str, torch.nn.Parameter], is_muon):
        self.stacks = {n: p for n, p in named_params.items() if is_muon(n) and p.ndim == 3}
        self.slices = {
            n: [torch.nn.Parameter(p.data[e].clone()) for e in range(p.shape[0])] for n, p in self.stacks.items()
        }

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [s for slices in self.slices.values() for s in slices]

    def take_grads(self) -> None:
        for n, p in self.stacks.items():
            for e, s in enumerate(self.slices[n]):
                s.grad = p.grad[e].clone()
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        for n, p in self.stacks.items():
            p.copy_(torch.stack([s.data for s in self.slices[n]]))


def uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The `n` greedy tokens after `prompt`, each from a full forward of the whole sequence so far: the reference a
    KV-cached generation must equal (no cache, no padding, one row)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]
