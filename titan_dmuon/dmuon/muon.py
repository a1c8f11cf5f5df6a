"""dmuon.Muon: owner-gated Muon on the dedicated matrices, AdamW (foreach) on every other parameter.

Only the global owner of a matrix runs momentum, Newton-Schulz and the update, on its fp32 `_owned_data`;
the update follows `torch.optim.Muon` exactly (EMA momentum, Nesterov, decoupled weight decay, lr scaled
by the full matrix shape). The AdamW half is `torch.optim.AdamW`'s own functional kernel.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as _adamw_functional

from . import replicate_axis as _replicate
from . import tp as _tp
from .comm import Work
from .newton_schulz import Coefficients, default_ns_dtype, resolve_coefficients, zeropower_via_newtonschulz
from .state import state_of, unwrap

_MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_coefficients", "eps", "adjust_lr_fn")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's lr scaling, on the full logical matrix shape."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn must be 'original', 'match_rms_adamw' or None, got {adjust_lr_fn!r}")


class Muon(torch.optim.Optimizer):
    """Muon for the dedicated matrices of `model`, AdamW for the rest, in one optimizer.

    Param groups carry `kind` "muon" or "adamw" so an lr scheduler scales both halves. `param_groups` is
    an optional list of `{"params": [...], **overrides}` dicts; each listed param takes those overrides
    (keys of its own kind), every other param the defaults. `model` may be wrapped in torch's
    DistributedDataParallel (after `dedicate_params_ddp`).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Coefficients = "polar_express",
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "match_rms_adamw",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        param_groups: Sequence[dict[str, Any]] | None = None,
        ns_dtype: torch.dtype | None = None,
        replicate_async: bool = True,
        tp_distributed_gram: bool = False,
    ):
        state = state_of(model, "dmuon.Muon")
        model = unwrap(model)
        if any(g.on_meta for g in state.groups):
            raise RuntimeError(
                "dmuon.Muon: the dedicated params are still on the meta device: call "
                "dmuon.init_dedicated_params(model, init_fn, device) first"
            )
        _check_registered(model, state)
        adjusted_lr(1.0, adjust_lr_fn, (1, 1))  # validate early
        resolve_coefficients(ns_coefficients, ns_steps)
        self.model = model
        self._state = state
        self.ns_dtype = ns_dtype
        self.replicate_async = replicate_async
        self.tp_distributed_gram = tp_distributed_gram
        muon_defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay)
        groups = self._build_groups(model, param_groups or [], muon_defaults, adamw_defaults)
        super().__init__(groups, {})
        self.last_step_stats: dict[str, float] = {}

    def _build_groups(self, model, user_groups, muon_defaults, adamw_defaults) -> list[dict]:
        dedicated = self._state.by_param
        override: dict[nn.Parameter, int] = {}
        for i, ug in enumerate(user_groups):
            for p in ug["params"]:
                override[p] = i
        buckets: dict[tuple[str, int], list[nn.Parameter]] = {}
        for p in model.parameters():
            if not p.requires_grad:
                continue
            kind = "muon" if p in dedicated else "adamw"
            buckets.setdefault((kind, override.get(p, -1)), []).append(p)
        groups = []
        for (kind, ui), params in buckets.items():
            opts = dict(muon_defaults if kind == "muon" else adamw_defaults)
            if ui >= 0:
                keys = _MUON_KEYS if kind == "muon" else _ADAMW_KEYS
                opts.update({k: v for k, v in user_groups[ui].items() if k in keys})
            groups.append({"params": params, "kind": kind, **opts})
        return groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for dp in self._state.dparams:
            dp._reduced_grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self._state
        st.drain_publish()  # a publish still in flight reads `_owned_data`: never update under it
        st.reshard_all()  # any unsharded buffer is stale after this step
        ns_calls, ns_time = 0, 0.0
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
        muon_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        opts_of = {p: g for g in muon_groups for p in g["params"]}
        for pgroup in st.groups:
            tp_jobs = []
            for dp in pgroup.params:
                if not dp.is_owner or dp._reduced_grad is None:
                    continue
                opts = opts_of[dp.param]
                update = self._momentum(dp, opts)
                if dp.tp_group is None:
                    t0 = time.perf_counter()
                    _apply_update(dp, self._orthogonalize(update, opts), opts)
                    ns_time += time.perf_counter() - t0
                    ns_calls += 1
                elif self.tp_distributed_gram and _tp.gram_is_beneficial(dp):
                    t0 = time.perf_counter()  # every TP rank iterates on the s×s Gram: no gather/scatter
                    _apply_update(dp, self._orthogonalize(update, opts, dp), opts)
                    ns_time += time.perf_counter() - t0
                    ns_calls += int(dp.is_tp_owner)
                else:  # gather the update shards onto the TP owner (async, all of the group's at once)
                    # the update may be applied after this step returns (async): snapshot this step's
                    # hyper-parameters now, before an lr scheduler changes the group
                    tp_jobs.append((_tp.TPUpdate(dp, update, st.ledger, st.tp_buffers), dict(opts)))
            for job, opts in tp_jobs:
                full = job.full_update()
                ortho = None
                if full is not None:
                    t0 = time.perf_counter()
                    ortho = self._orthogonalize(full, opts)
                    ns_time += time.perf_counter() - t0
                    ns_calls += 1
                job.scatter(ortho, like=job.dp._owned_data)
            publish = _replicate.publish(pgroup, [dp for dp in pgroup.params if dp.tp_group is None])
            # TP params wait for their scatter before the update, then publish: every rank of the owner's
            # column (owner or peer) runs this tail at the same point (the group's next wait_publish).
            tp_column = [dp for dp in pgroup.params if dp.tp_group is not None and dp.in_owner_column]
            finish = functools.partial(_finish_tp, pgroup, tp_jobs, tp_column) if tp_jobs or tp_column else None
            pgroup.after_step(publish, finish)
        if not self.replicate_async:  # sync: consume every group's handoff before step() returns
            st.drain_publish()
        st.ledger.end_step()
        self.last_step_stats = {
            "ns_calls": float(ns_calls),
            "ns_time_s": ns_time,
            **{f"elements_{k}": v for k, v in st.ledger.last_step.items()},
            **{f"bytes_{k}": v for k, v in st.ledger.last_step_bytes.items()},
        }
        return loss

    def _momentum(self, dp, opts: dict) -> torch.Tensor:
        """EMA momentum (+ Nesterov) on this rank's (TP-local) grad: elementwise, so shards suffice."""
        grad = dp._reduced_grad
        state = self.state[dp.param]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(grad)
        mu = opts["momentum"]
        buf.lerp_(grad, 1 - mu)
        return grad.lerp(buf, mu) if opts["nesterov"] else buf

    def _orthogonalize(self, update: torch.Tensor, opts: dict, tp_gram_of=None) -> torch.Tensor:
        """NS of a full matrix, or (TP distributed Gram) of this rank's block of `tp_gram_of`'s matrix."""
        extra = {}
        if tp_gram_of is not None:
            extra = dict(
                formulation="gram",
                full_shape=tp_gram_of.full_shape,
                reduce_gram=functools.partial(_tp.all_reduce_gram, tp_gram_of, self._state.ledger),
            )
        return zeropower_via_newtonschulz(
            update,
            ns_steps=opts["ns_steps"],
            coefficients=opts["ns_coefficients"],
            eps=opts["eps"],
            dtype=self.ns_dtype or default_ns_dtype(update.device),
            **extra,
        )

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _apply_update(dp, ortho: torch.Tensor, opts: dict) -> None:
    """Decoupled weight decay, then the lr-scaled orthogonal step (lr scaled by the full logical shape)."""
    data = dp._owned_data
    data.mul_(1 - opts["lr"] * opts["weight_decay"])
    data.add_(ortho.to(data.dtype), alpha=-adjusted_lr(opts["lr"], opts["adjust_lr_fn"], dp.full_shape))


def _finish_tp(pgroup, tp_jobs, tp_column) -> Work:
    """Wait for the TP scatters, apply the shards' updates, then publish them over the replicate axis."""
    for job, opts in tp_jobs:
        _apply_update(job.dp, job.wait(), opts)
    return _replicate.publish(pgroup, tp_column)


def _check_registered(model: nn.Module, state) -> None:
    """Every dedicated param must still be the one the model holds: a wrapper that swaps params (torch DDP's
    TP transform turns DTensor params into new local ones) would leave DMuon's hooks on dead tensors."""
    registered = set(model.parameters())
    lost = [dp.fqn for dp in state.dparams if dp.param not in registered]
    if lost:
        raise RuntimeError(
            f"dmuon.Muon: the dedicated params {lost[:3]} are no longer registered in the model (something "
            "replaced them after dedicate_params; torch DistributedDataParallel over a TP mesh does): with TP "
            "use dmuon.replicate_tp(model, mesh['dp']) instead of DistributedDataParallel"
        )
