"""The dense feed-forward of the decoder families: SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_dmuon.components.initialization import ParamInit, trunc_normal


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); Hugging Face's gate_proj (w1), up_proj (w3) and down_proj (w2)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def param_inits(self, out: ParamInit) -> dict[str, ParamInit]:
        """torchtitan's init (FQNs relative to this module): w1 trunc_normal(0.02), w2 and w3 `out` (the block's
        depth-scaled std)."""
        return {"w1.weight": trunc_normal(0.02), "w2.weight": out, "w3.weight": out}


__all__ = ["FeedForward"]
