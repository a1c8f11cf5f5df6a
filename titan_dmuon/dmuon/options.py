"""dmuon.MuonOptions: the hyper-parameters of the Muon update, defined, defaulted, documented and checked here once.

`dmuon.Muon`, the framework's `muon_naive` baseline and the framework's `[optimizer.muon]` config table all build
one of these. The defaults are `torch.optim.Muon`'s (lr 1e-3, momentum 0.95, Nesterov, weight decay 0.1, 5 NS
steps of Keller Jordan's coefficients, eps 1e-7, the "original" lr adjustment), so `dmuon.Muon(model)` takes the
step `torch.optim.Muon(params)` takes (tests/unit/dmuon/test_options.py holds them to it); the framework's config
chooses its own (AdamW-sized lrs: "match_rms_adamw", Polar Express) explicitly.

DTYPES / `to_dtype` is the one map from a dtype's name to the torch.dtype, for every option that names one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from titan_dmuon.dtypes import DTYPES, to_dtype

from .newton_schulz import FORMULATIONS, NS_MAX_BATCH_ELEMENTS, Coefficients, default_ns_dtype, resolve_coefficients
from .ns_ops import KERNELS

ADJUST_LR_FNS = ("original", "match_rms_adamw")


class OptionError(ValueError):
    """An invalid Muon option: `field` names it, `problem` says what is wrong and how to fix it."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"dmuon.MuonOptions.{field} {problem}")


@dataclass(frozen=True)
class MuonOptions:
    """The Muon update's hyper-parameters (defaults: torch.optim.Muon's). Immutable and checked on construction
    (OptionError, a ValueError naming the field); `replace(**changes)` gives a checked copy.

    The first eight fields (PER_GROUP) may also differ per param group (dmuon.Muon's `param_groups`, and an lr
    scheduler changes `lr` there); the NS dtype, formulation, kernel, batch bound and per-head switches hold for the
    whole optimizer.
    """

    lr: float = 1e-3
    """Learning rate of the Muon matrices, before the `adjust_lr_fn` shape scaling (and any lr schedule). The
    default 1e-3 is torch.optim.Muon's; with adjust_lr_fn="original" Keller Jordan's recipes use ~0.02, with
    "match_rms_adamw" take the lr you would give AdamW."""
    momentum: float = 0.95
    """EMA factor of the momentum buffer (buf <- momentum·buf + (1 - momentum)·grad), in [0, 1). Rarely changed."""
    nesterov: bool = True
    """Orthogonalize the Nesterov look-ahead (1 - momentum)·grad + momentum·buf instead of the buffer itself."""
    weight_decay: float = 0.1
    """Decoupled weight decay: W <- W·(1 - lr·weight_decay) before the update (the un-adjusted lr). 0 turns it off."""
    ns_steps: int = 5
    """Newton-Schulz iterations, in [1, 99]: fewer are cheaper and less orthogonal; 5 suits both coefficient sets."""
    ns_coefficients: Coefficients = "muon"
    """The quintic's (a, b, c): "muon" = Keller Jordan's (3.4445, -4.775, 2.0315) every step (torch.optim.Muon's),
    "polar_express" = the Polar Express table (Amsel et al., 2025: one optimal triple per step, input normalized with
    a 1.01 cushion; more orthogonal in the same steps), one triple (repeated), or a list of triples (the last one
    repeated for further steps)."""
    eps: float = 1e-7
    """Floor of the Frobenius norm Newton-Schulz divides the update by (guards an all-zero update)."""
    adjust_lr_fn: str | None = "original"
    """How the lr scales with the full matrix shape (rows, cols): "original" (or None, as torch.optim.Muon) =
    lr·sqrt(max(1, rows/cols)); "match_rms_adamw" = lr·0.2·sqrt(max(rows, cols)), an update of AdamW's RMS, so
    Muon can share AdamW's lr and schedule."""
    ns_dtype: torch.dtype | str | None = None
    """Precision of Newton-Schulz (a torch.dtype or its name in DTYPES; normalized to a torch.dtype). None = the
    device's default (`dmuon.default_ns_dtype`): bfloat16 on CUDA and on CPUs with native bf16 matmuls, float32
    elsewhere. Pin torch.float32 where runs must agree to fp32 rounding (layout parity tests)."""
    ns_formulation: str = "direct"
    """"direct" = torch.optim.Muon's iteration on the matrix; "gram" = the same polynomial on the short-side Gram
    matrix with restarts: fewer FLOPs for rectangular matrices (docs/dmuon.md, "The update")."""
    kernel: str = "auto"
    """Who runs Newton-Schulz's symmetric products: "auto" = Triton on CUDA when it imports and passes a one-time
    numerical check, else torch (the DMUON_NS_KERNEL environment variable overrides "auto"); "triton"; "torch"."""
    ns_max_batch_elements: int = NS_MAX_BATCH_ELEMENTS
    """Bound on the elements of one batched Newton-Schulz call (an owner runs its same-shape matrices as one batch,
    in chunks of at most this many elements): lower it when NS's temporary memory is tight; 1 runs them one by one."""
    per_head: bool = False
    """Per-head Muon (docs/dmuon.md, "Per-head Muon"): split each matrix that has head blocks (`dedicate_params(...,
    head_blocks={fqn: (dim, size)})`) into blocks of `size` along `dim` and orthogonalize each block on its own, its
    lr scaled by the block's shape (`adjust_lr_fn`). Row blocks (dim 0: wq/wk/wv's output heads) only, unless
    `per_head_wo`. Under TP a matrix whose blocks lie whole in its TP shards (blocked dim = TP shard dim, local
    size a multiple of the block size) is orthogonalized on each TP rank with no TP gather or scatter; others
    gather, run per-head NS on the full matrix and scatter. dmuon.Muon raises when no head blocks were recorded."""
    per_head_wo: bool = False
    """With `per_head`, also split the matrices whose head blocks are column blocks (dim 1: an attention output
    projection wo, whose input dim holds the heads); False (the default) orthogonalizes those whole."""
    qk_clip_tau: float = 0.0
    """QK-clip (MuonClip; docs/dmuon.md, "QK-clip"): after each step, every attention head whose largest logit
    q·k/sqrt(d) of the step exceeded tau gets its query/key weights scaled so that it would be tau. 0 (the default)
    is off; the Kimi K2 recipe uses 100. The model reports its heads (titan_dmuon/dmuon/qk_clip.py: each attention
    layer's `qk_heads()` and `max_logit`)."""

    PER_GROUP: ClassVar[tuple[str, ...]] = (
        "lr",
        "momentum",
        "nesterov",
        "weight_decay",
        "ns_steps",
        "ns_coefficients",
        "eps",
        "adjust_lr_fn",
    )
    """The fields a param group may override (and that an optimizer's param groups carry)."""

    def __post_init__(self) -> None:
        _number("lr", self.lr, minimum=0.0)
        _number("momentum", self.momentum, minimum=0.0)
        if not self.momentum < 1:
            raise OptionError("momentum", f"must be in [0, 1), got {self.momentum!r} (0.95 is the usual value)")
        if not isinstance(self.nesterov, bool):
            raise OptionError("nesterov", f"must be True or False, got {self.nesterov!r}")
        _number("weight_decay", self.weight_decay, minimum=0.0)
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or not 1 <= self.ns_steps <= 99:
            raise OptionError(
                "ns_steps", f"must be an integer in [1, 99], got {self.ns_steps!r} (5 is the usual value)"
            )
        try:
            resolve_coefficients(self.ns_coefficients, self.ns_steps)
        except (ValueError, TypeError) as e:
            raise OptionError("ns_coefficients", f"is invalid ({e}), got {self.ns_coefficients!r}") from None
        _number("eps", self.eps, minimum=0.0)
        if self.adjust_lr_fn is not None and self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise OptionError(
                "adjust_lr_fn", f"must be 'original', 'match_rms_adamw' or None, got {self.adjust_lr_fn!r}"
            )
        if self.ns_dtype is not None:
            try:
                dtype = to_dtype(self.ns_dtype)
            except ValueError as e:
                raise OptionError("ns_dtype", f"is invalid: {e} (or None for the device's default)") from None
            if not dtype.is_floating_point:
                raise OptionError("ns_dtype", f"must be a floating-point dtype, got {dtype}")
            object.__setattr__(self, "ns_dtype", dtype)
        if self.ns_formulation not in FORMULATIONS:
            raise OptionError("ns_formulation", f"must be one of {FORMULATIONS}, got {self.ns_formulation!r}")
        if self.kernel not in KERNELS:
            raise OptionError("kernel", f"must be one of {KERNELS}, got {self.kernel!r}")
        m = self.ns_max_batch_elements
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise OptionError("ns_max_batch_elements", f"must be an integer >= 1, got {m!r}")
        for name in ("per_head", "per_head_wo"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be True or False, got {getattr(self, name)!r}")
        _number("qk_clip_tau", self.qk_clip_tau, minimum=0.0)
        if self.per_head_wo and not self.per_head:
            raise OptionError("per_head_wo", "needs per_head=True (it adds wo's column blocks to per-head Muon)")

    def replace(self, **changes: Any) -> MuonOptions:
        """A checked copy with `changes`; TypeError naming the valid fields for an unknown one."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"unknown Muon option(s) {unknown}: the fields of dmuon.MuonOptions are {sorted(names)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, options: MuonOptions | None = None, **overrides: Any) -> MuonOptions:
        """`options` (default: MuonOptions()) with the keyword `overrides`, checked: how an optimizer takes an
        `options` argument and keyword fields together."""
        if options is None:
            options = cls()
        elif not isinstance(options, MuonOptions):
            raise TypeError(
                f"`options` must be a dmuon.MuonOptions, got {options!r}; pass the Muon hyper-parameters by keyword "
                "(lr=..., momentum=...)"
            )
        return options.replace(**overrides) if overrides else options

    def group_defaults(self) -> dict[str, Any]:
        """The PER_GROUP fields, as a Muon param group carries them."""
        return {k: getattr(self, k) for k in self.PER_GROUP}

    def check_group(self, group: Mapping[str, Any]) -> None:
        """OptionError when a param group's PER_GROUP values (an override) are invalid."""
        self.replace(**{k: v for k, v in group.items() if k in self.PER_GROUP})

    def active_blocks(self, blocks: tuple[int, int] | None) -> tuple[int, int] | None:
        """The head blocks `(dim, size)` the update splits a matrix into, given the ones recorded for it: `blocks`
        with `per_head` on (column blocks, dim 1, only with `per_head_wo`), else None (the whole matrix)."""
        if blocks is None or not self.per_head or (blocks[0] == 1 and not self.per_head_wo):
            return None
        return blocks

    def ns_kwargs(self, group: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
        """`zeropower_via_newtonschulz`'s keyword arguments for a matrix of `group` (its ns_steps, coefficients and
        eps) on `device` (the NS dtype resolved: None -> the device's default)."""
        return dict(
            ns_steps=group["ns_steps"],
            coefficients=group["ns_coefficients"],
            eps=group["eps"],
            dtype=self.ns_dtype or default_ns_dtype(device),
            formulation=self.ns_formulation,
            kernel=self.kernel,
        )


def _number(field: str, value: Any, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < minimum:
        raise OptionError(field, f"must be a number >= {minimum:g}, got {value!r}")


__all__ = ["ADJUST_LR_FNS", "DTYPES", "MuonOptions", "OptionError", "to_dtype"]
