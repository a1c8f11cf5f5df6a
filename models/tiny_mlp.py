"""The quick-start model: a residual MLP whose every layer is a module with a forward.

One definition for the quick-start example, the step benchmark and the DMuon tests. Its matrices are named
`*_proj` (the quick start's Muon predicate: `"proj" in name and p.ndim == 2`); the loss is a mean, so per-rank losses
average like one concatenated batch.
"""

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
    def __init__(self, d: int = 256, ff: int = 1024, n_layers: int = 4, n_out: int = 1):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, ff) for _ in range(n_layers)])
        self.head = nn.Linear(d, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def is_muon_target(name: str, p: torch.Tensor) -> bool:
    """The quick start's Muon predicate: the block matrices."""
    return "proj" in name and p.ndim == 2
