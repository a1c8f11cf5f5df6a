"""Rotary position embeddings: one table, two ways to pair a head's dimensions.

The table is real-valued, ``[max_seq_len, head_dim // 2, 2]`` of (cos, sin) per position and pair, rather than
complex, so that meta-device construction, ``to_empty`` and ``torch.compile`` need no complex support. Which
dimensions form pair i is the checkpoint's convention, so each family picks its layout:

  * ``"interleaved"`` (Meta's Llama checkpoints): dimensions 2i and 2i + 1;
  * ``"rotate_half"`` (Hugging Face's, Qwen3's): dimensions i and i + head_dim/2.

Both rotate in fp32 and return ``x``'s dtype.

A long-context model stretches the table with YaRN (`Yarn`, DeepSeek-V3's and Kimi K2's ``rope_scaling``): the
low frequencies are interpolated by ``factor``, the high ones kept, a linear ramp between; cos and sin carry the
attention factor, and the softmax scale that the scaling implies is `Yarn.softmax_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeLayout = Literal["interleaved", "rotate_half"]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling: Hugging Face's ``rope_scaling`` fields of ``"rope_type": "yarn"`` (the module docstring
    says what it computes)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """The [dim / 2] frequencies: pair i's extrapolated (``theta``'s) and interpolated (/ factor) frequencies
        blended by a ramp over the pairs between the ones making ``beta_fast`` and ``beta_slow`` turns over the
        original context (bounds floored and ceiled)."""

        def pair(turns: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair(self.beta_fast)), 0)
        high = min(math.ceil(pair(self.beta_slow)), dim - 1)
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        return (1.0 / (self.factor * base)) * ramp + (1.0 / base) * (1 - ramp)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (1 when mscale equals mscale_all_dim, as DeepSeek-V3's)."""
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def softmax_scale(self, head_dim: int) -> float:
        """The logits' scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when ``mscale_all_dim`` is set."""
        m = _yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
        return head_dim**-0.5 * m * m

    @classmethod
    def from_hf(cls, fields: dict) -> Yarn:
        """The scaling a config.json's yarn ``rope_scaling`` / ``rope_parameters`` describes, its absent fields read
        as transformers reads them (beta_fast 32, beta_slow 1; without mscale, cos and sin carry mscale(factor), as
        with mscale 0 here; without mscale_all_dim, the softmax scale is head_dim^-0.5). KeyError without factor
        or original_max_position_embeddings."""
        return cls(
            factor=fields["factor"],
            original_max_position_embeddings=fields["original_max_position_embeddings"],
            beta_fast=fields.get("beta_fast") or 32.0,
            beta_slow=fields.get("beta_slow") or 1.0,
            mscale=fields.get("mscale") or 0.0,
            mscale_all_dim=fields.get("mscale_all_dim") or 0.0,
        )

    def scales_like(self, other: Yarn, dim: int, theta: float) -> bool:
        """Whether ``other`` gives ``dim`` rotary dims the same frequencies, cos/sin factor and softmax scale (other
        fields can: mscale 0 and 1 without mscale_all_dim, or original contexts that put the ramp on the same pairs)."""
        return (
            math.isclose(self.attention_factor, other.attention_factor)
            and math.isclose(self.softmax_scale(dim), other.softmax_scale(dim))
            and torch.allclose(self.inv_freq(dim, theta), other.inv_freq(dim, theta), rtol=1e-6, atol=0)
        )

    def hf(self) -> dict:
        """The ``rope_scaling`` / ``rope_parameters`` fields of config.json (without rope_theta)."""
        return {
            "rope_type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
        }


def precompute_rope(head_dim: int, max_seq_len: int, theta: float, yarn: Yarn | None = None) -> torch.Tensor:
    """Return the RoPE table ``[max_seq_len, head_dim // 2, 2]`` holding (cos, sin) per position and pair
    (YaRN-scaled with ``yarn``)."""
    if yarn is None:
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        scale = 1.0
    else:
        freqs, scale = yarn.inv_freq(head_dim, theta), yarn.attention_factor
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return table if scale == 1.0 else table * scale


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


__all__ = ["RopeLayout", "Yarn", "apply_rope", "apply_rope_interleaved", "apply_rope_rotate_half", "precompute_rope"]
