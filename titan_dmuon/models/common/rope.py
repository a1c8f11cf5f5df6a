"""Rotary position embeddings: one table, two ways to pair a head's dimensions.

The table is real-valued, ``[max_seq_len, head_dim // 2, 2]`` of (cos, sin) per position and pair, rather than
complex, so that meta-device construction, ``to_empty`` and ``torch.compile`` need no complex support. Which
dimensions form pair i is the checkpoint's convention, so each family picks its layout:

  * ``"interleaved"`` (Meta's Llama checkpoints): dimensions 2i and 2i + 1;
  * ``"rotate_half"`` (Hugging Face's, Qwen3's): dimensions i and i + head_dim/2.

Both rotate in fp32 and return ``x``'s dtype.
"""

from __future__ import annotations

from typing import Literal

import torch

RopeLayout = Literal["interleaved", "rotate_half"]


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Return the RoPE table ``[max_seq_len, head_dim // 2, 2]`` holding (cos, sin) per position and pair."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _cos_sin(rope: torch.Tensor, seqlen: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) broadcastable to ``[B, L, H, D // 2]``: positions ``0..L-1`` of the table ``[max_seq_len, D // 2,
    2]``, or each row's own positions ``[B, L, D // 2, 2]`` (a KV-cached decode step, left-padded prompts)."""
    if rope.dim() == 4:
        return rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)
    return rope[:seqlen, :, 0].view(1, seqlen, 1, half), rope[:seqlen, :, 1].view(1, seqlen, 1, half)


def apply_rope_interleaved(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (Meta's interleaved layout) of ``x [B, L, H, D]`` by ``rope`` (see `_cos_sin`)."""
    b, seqlen, h, d = x.shape
    xr = x.float().reshape(b, seqlen, h, d // 2, 2)
    cos, sin = _cos_sin(rope, seqlen, d // 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(3).type_as(x)


def apply_rope_rotate_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` in Hugging Face's rotate_half layout: dimension i (< D/2) and i + D/2 of a head are
    one pair, turned by pair i's angle (``rope``: see `_cos_sin`)."""
    seqlen, half = x.shape[1], x.shape[3] // 2
    cos, sin = _cos_sin(rope, seqlen, half)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    """``x [B, L, H, D]`` rotated by ``rope`` with the pairs of ``layout``."""
    if layout == "interleaved":
        return apply_rope_interleaved(x, rope)
    return apply_rope_rotate_half(x, rope)


__all__ = ["RopeLayout", "apply_rope", "apply_rope_interleaved", "apply_rope_rotate_half", "precompute_rope"]
