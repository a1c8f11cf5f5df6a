"""Normalization layers of the decoder families."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm written with elementwise ops and a last-dim mean, so it runs on sequence-sharded DTensors (and, over
    head_dim, on TP-sharded heads: Qwen3's q/k norms)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


__all__ = ["RMSNorm"]
