"""Warmup -> stable -> decay learning-rate schedule (WSD), as one LambdaLR over every param group.

The factor multiplies each group's own base lr, so the Muon group and the AdamW group of DMuon keep
their ratio through the whole schedule.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

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


def resolve_phases(cfg: LRSchedulerConfig, total_steps: int) -> tuple[int, int]:
    """(warmup_steps, decay_steps) clamped to total_steps, warmup taking precedence over decay."""
    warmup = cfg.warmup_steps
    if warmup > total_steps:
        logger.warning("lr_scheduler.warmup_steps (%d) > training steps (%d); clamping", warmup, total_steps)
        warmup = total_steps
    if cfg.decay_ratio is None:
        decay = total_steps - warmup
    else:
        decay = round(total_steps * cfg.decay_ratio)
        if warmup + decay > total_steps:
            logger.warning(
                "warmup (%d) + decay (%d) steps exceed training steps (%d); decaying over the rest",
                warmup,
                decay,
                total_steps,
            )
            decay = total_steps - warmup
    return warmup, decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    """LambdaLR scaling every param group's initial lr by lr_factor; call .step() after each optimizer step."""
    warmup, decay = resolve_phases(cfg, total_steps)
    fn = functools.partial(
        lr_factor,
        warmup_steps=warmup,
        decay_steps=decay,
        total_steps=total_steps,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return LambdaLR(optimizer, lr_lambda=fn)
