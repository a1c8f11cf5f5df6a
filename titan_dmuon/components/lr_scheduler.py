"""Warmup -> stable -> decay learning-rate schedule (WSD), as one LambdaLR over every param group.

The factor multiplies each group's own base lr, so the Muon group and the AdamW group of DMuon keep
their ratio through the whole schedule. The schedule is a function of the config (`schedule_fields`) and of the step:
a checkpoint keeps only the step, so a resume with other values of those fields moves the lr (`schedule_change`
says by how much).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_dmuon.config import JobConfig
from titan_dmuon.config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger(__name__)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> float:
    """The lr multiplier for 0-indexed optimizer step `step` (the number of scheduler.step() calls so far).

    Warmup: (step+1)/(warmup_steps+1), so step 0 trains at a small but nonzero lr. Decay over the last
    `decay_steps` steps mirrors it: progress (k+1)/(decay_steps+1) for the k-th decay step, so no step is
    wasted at exactly the stable or the minimum lr; past total_steps the factor stays at min_lr_factor.
    """
    decay_start = total_steps - decay_steps
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (decay_steps + 1))
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown decay_type {decay_type!r}: use 'linear', 'cosine' or 'sqrt'")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def resolve_phases(cfg: LRSchedulerConfig, total_steps: int, warn: bool = True) -> tuple[int, int]:
    """(warmup_steps, decay_steps) clamped to total_steps, warmup taking precedence over decay (`warn`: log each
    clamp; off when computing another run's schedule, whose clamps are not this run's news)."""
    warmup = cfg.warmup_steps
    if warmup > total_steps:
        if warn:
            logger.warning("lr_scheduler.warmup_steps (%d) > training steps (%d); clamping", warmup, total_steps)
        warmup = total_steps
    if cfg.decay_ratio is None:
        decay = total_steps - warmup
    else:
        decay = round(total_steps * cfg.decay_ratio)
        if warmup + decay > total_steps:
            if warn:
                logger.warning(
                    "warmup (%d) + decay (%d) steps exceed training steps (%d); decaying over the rest",
                    warmup,
                    decay,
                    total_steps,
                )
            decay = total_steps - warmup
    return warmup, decay


def schedule(cfg: LRSchedulerConfig, total_steps: int, warn: bool = True) -> Callable[[int], float]:
    """The lr factor as a function of the 0-indexed optimizer step, for `total_steps` training steps."""
    warmup, decay = resolve_phases(cfg, total_steps, warn=warn)
    return functools.partial(
        lr_factor,
        warmup_steps=warmup,
        decay_steps=decay,
        total_steps=total_steps,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    """LambdaLR scaling every param group's initial lr by lr_factor; call .step() after each optimizer step."""
    return LambdaLR(optimizer, lr_lambda=schedule(cfg, total_steps))


def base_lr(cfg: JobConfig, kind: str) -> float:
    """The initial lr of a param group of `kind` ("muon", "adamw"): its `[optimizer.<kind>]` table's lr, which is
    what every optimizer component gives the groups of that kind."""
    return getattr(cfg.optimizer, kind).lr


def schedule_fields(cfg: JobConfig, kinds: Iterable[str]) -> dict[str, Any]:
    """The config fields the lr of each kind's groups is a function of, besides the step, by dotted name."""
    fields: dict[str, Any] = {"training.steps": cfg.training.steps}
    for f in dataclasses.fields(cfg.lr_scheduler):
        fields[f"lr_scheduler.{f.name}"] = getattr(cfg.lr_scheduler, f.name)
    for kind in kinds:
        fields[f"optimizer.{kind}.lr"] = base_lr(cfg, kind)
    return fields


def _value(v: Any) -> str:
    return "unset" if v is None else repr(v)


def schedule_change(saved: JobConfig, current: JobConfig, step: int, lrs_after: dict[str, float]) -> str | None:
    """One line naming the schedule fields that differ between the config a checkpoint of `step` was saved with and
    this run's (old -> new), and each kind's lr before and after: the lr step `step` trained at under the saved
    schedule, and `lrs_after[kind]`, the lr step `step + 1` trains at under this run's. None when no field differs."""
    old, new = schedule_fields(saved, lrs_after), schedule_fields(current, lrs_after)
    changed = [f"{name} {_value(old[name])} -> {_value(new[name])}" for name in old if old[name] != new[name]]
    if not changed:
        return None
    factor = schedule(saved.lr_scheduler, saved.training.steps, warn=False)(max(step - 1, 0))
    lrs = ", ".join(
        f"lr/{kind} {base_lr(saved, kind) * factor:.3e} -> {after:.3e}" for kind, after in lrs_after.items()
    )
    return (
        f"lr schedule changed on resume: {', '.join(changed)}; {lrs} (step {step} under the saved schedule -> "
        f"step {step + 1} under this run's); rerun with the saved values to keep the saved schedule"
    )
