"""Validation: the mean loss and perplexity of held-out data every validation.freq steps, like torchtitan's
Validator. It owns its loader (components/loaders.py) and asks the trainer only for a loss: the trainer's
forward, loss and loss-parallel context stay the trainer's."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_dmuon.components.loaders import build_job_dataloader
from titan_dmuon.config import JobConfig
from titan_dmuon.data import Tokenizer

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(inputs, labels) on the device -> one micro-batch's loss, a plain scalar tensor the same on every TP rank."""


class Validator:
    """validation.steps batches of the held-out data on every DP rank, their mean loss reduced over all ranks."""

    def __init__(
        self,
        cfg: JobConfig,
        tokenizer: Tokenizer,
        dp_rank: int,
        dp_world_size: int,
        device: torch.device,
        seed: int,
        loss_fn: LossFn,
    ):
        self.freq, self.steps = cfg.validation.freq, cfg.validation.steps
        self.device, self.loss_fn = device, loss_fn
        self.dataloader = build_job_dataloader(
            cfg, "val", tokenizer=tokenizer, dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed, device=device
        )

    def due(self, step: int) -> bool:
        """Whether to validate after `step`."""
        return step % self.freq == 0

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean loss and perplexity over validation.steps batches of the held-out data (all DP ranks)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, (inputs, labels) in enumerate(self.dataloader):
            if i >= self.steps:
                break
            total[0] += self.loss_fn(inputs.to(self.device), labels.to(self.device)).double()
            total[1] += 1
        dist.all_reduce(total)
        if total[1].item() == 0:
            logger.warning("validation: the held-out data gave no batch (too short for the batch shape)")
            return {}
        mean = (total[0] / total[1]).item()
        return {"loss/validation": mean, "perplexity/validation": math.exp(min(mean, 700.0))}


__all__ = ["LossFn", "Validator"]
