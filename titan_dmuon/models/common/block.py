"""The decoder block of the families: pre-norm attention and feed-forward, each added to the residual stream."""

from __future__ import annotations

import torch
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, trunc_normal
from titan_dmuon.components.kv_cache import LayerCache

from .norms import RMSNorm


def depth_init_std(layer_id: int, n_layers: int, depth_init: bool) -> float:
    """torchtitan's std for a block's output projections: 0.02 / sqrt(2 * depth), depth the block's 1-based index
    (``depth_init``) or the model's layer count."""
    depth = (layer_id + 1) if depth_init else n_layers
    return 0.02 / (2 * depth) ** 0.5


class TransformerBlock(nn.Module):
    """One pre-norm block around the family's `attention` and `feed_forward` (a dense FeedForward or an MoE); a
    module with its own forward so FSDP2/DMuon hooks can attach at ``layers.N``.

    Both children take ``param_inits(out)`` (their params' distributions, the output projections' given): the
    block hands them trunc_normal(``init_std``)."""

    def __init__(
        self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module, init_std: float
    ):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = feed_forward
        self.weight_init_std = init_std

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        normed = self.attention_norm(x)
        h = x + (self.attention(normed, rope) if cache is None else self.attention(normed, rope, cache))
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """This block's params (FQNs relative to the block): norms 1, the input projections trunc_normal(0.02), the
        output ones (wo, w2, w3; an MoE's expert stacks alike) trunc_normal with the depth-scaled std."""
        out = trunc_normal(self.weight_init_std)
        return {
            "attention_norm.weight": constant(1.0),
            "ffn_norm.weight": constant(1.0),
            **{f"attention.{k}": v for k, v in self.attention.param_inits(out).items()},
            **{f"feed_forward.{k}": v for k, v in self.feed_forward.param_inits(out).items()},
        }


__all__ = ["TransformerBlock", "depth_init_std"]
