"""`adamw`: torch.optim.AdamW on every parameter, all of them FSDP2-managed (the plain baseline)."""

from __future__ import annotations

import torch

from .base import OptimizerComponent, register_optimizer


@register_optimizer
class AdamW(OptimizerComponent):
    """AdamW with `[optimizer.adamw]` on every param; the base class's FSDP2 defaults do the rest."""

    name = "adamw"

    def build(self) -> torch.optim.Optimizer:
        a = self.cfg.optimizer.adamw
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": params, "kind": "adamw"}], lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay
        )
        return self.optimizer
