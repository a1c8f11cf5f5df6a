"""Tiny models shared by the tests (seed 003's quick-start model, each layer a module with a forward)."""
from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.down_proj(self.gate_proj(h) * self.up_proj(h))


class TinyMLP(nn.Module):
    """Seed 003's TinyMLP; the loss is a mean so per-rank losses average like one concatenated batch."""

    def __init__(self, d: int = 32, ff: int = 64, n_layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, ff) for _ in range(n_layers)])
        self.head = nn.Linear(d, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def proj_predicate(name: str, p: torch.Tensor) -> bool:
    return "proj" in name and p.ndim == 2


def batch(step: int, rank: int, b: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(b, d, generator=g)
