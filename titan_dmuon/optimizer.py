"""build_optimizer: dmuon.Muon (Muon on the dedicated matrices + AdamW on the rest) or plain AdamW."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_dmuon.config import JobConfig

_NS_DTYPES = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """Call after parallelize. "dmuon" needs the model's dedicated params (dmuon.dedicate_params ran);
    "adamw" takes every param with the adamw_* settings."""
    o = cfg.optimizer
    if o.name == "dmuon":
        from titan_dmuon import dmuon

        return dmuon.Muon(
            model,
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            ns_steps=o.ns_steps,
            ns_coefficients=o.ns_coefficients,
            eps=o.eps,
            adjust_lr_fn=o.adjust_lr_fn,
            adamw_lr=o.adamw_lr,
            adamw_betas=tuple(o.adamw_betas),
            adamw_eps=o.adamw_eps,
            adamw_weight_decay=o.adamw_weight_decay,
            ns_dtype=_NS_DTYPES[o.ns_dtype],
            replicate_async=cfg.parallelism.replicate_async,
            tp_distributed_gram=o.tp_distributed_gram,
        )
    if o.name == "adamw":
        return torch.optim.AdamW(
            model.parameters(),
            lr=o.adamw_lr,
            betas=tuple(o.adamw_betas),
            eps=o.adamw_eps,
            weight_decay=o.adamw_weight_decay,
        )
    raise ValueError(f"unknown optimizer {o.name!r}: use 'dmuon' or 'adamw'")
