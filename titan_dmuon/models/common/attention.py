"""Grouped-query attention of the decoder families: optional per-head q/k RMSNorm, RoPE in the family's layout,
causal SDPA in training and the KV cache's masked path in generation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, trunc_normal
from titan_dmuon.components.kv_cache import LayerCache
from titan_dmuon.dmuon.qk_clip import QKHeads, report_max_logit

from .norms import RMSNorm
from .rope import RopeLayout, apply_rope


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """``q [B, L, H, D]`` over ``k [B, T, H, D]`` and ``v [B, T, H, Dv]`` -> ``[B, L, H, Dv]``: causal, or under the
    boolean ``mask [B, 1, L, T]`` (True: attend); logits scaled by ``scale`` (default D^-0.5)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, cache: LayerCache | None = None
) -> torch.Tensor:
    """Causal attention of ``q [B, L, H, D]`` over ``k, v [B, L, H_kv, D]`` (each kv head serves ``n_rep`` query
    heads) -> ``[B, L, H, D]``. With a ``cache`` (generation) the step's k and v join the cached ones and the
    cache's mask replaces the causal one."""
    mask = None
    if cache is not None:  # generation: attend to every cached position the mask allows
        k, v, mask = cache.update(k, v)
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    return sdpa(q, k, v, mask)


class Attention(nn.Module):
    """Grouped-query attention (`wq wk wv wo`, no biases). Head counts come from the projections' (possibly
    TP-sharded) output width via ``view(..., -1, head_dim)``, so the same code runs with n_heads // tp local heads.

    With ``qk_norm`` (Qwen3) an RMSNorm over head_dim (`q_norm`, `k_norm`, weights of head_dim entries) normalizes
    each q and k head before RoPE; it acts on the last dim only, so it runs on any subset of the heads.

    It reports its per-head max logits to QK-clip (titan_dmuon/dmuon/qk_clip.py): `qk_heads()` says which params
    hold the heads (the q/k norms' gains under a QK-norm), `max_logit` is None until the clip measures. Under TP
    `tp_rank`/`tp_size` (set by the TP plan) place this rank's heads among the layer's."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope_layout: RopeLayout,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads  # the whole layer's
        self.tp_rank, self.tp_size = 0, 1
        self.max_logit: torch.Tensor | None = None  # QK-clip's running max over this step's forwards [local heads]
        self.n_rep = n_heads // n_kv_heads  # invariant under TP: q and kv heads shard alike
        self.rope_layout = rope_layout
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope, self.rope_layout), apply_rope(k, rope, self.rope_layout)
        if self.max_logit is not None and cache is None:
            report_max_logit(self, q, k)
        return self.wo(attend(q, k, v, self.n_rep, cache).reshape(bs, seqlen, -1))

    def qk_heads(self) -> QKHeads:
        """Where QK-clip finds this layer's heads: wq/wk rows, or the q/k norms' gains (one per layer)."""
        local = self.n_heads // self.tp_size
        return QKHeads(
            q="q_norm.weight" if self.q_norm is not None else "wq.weight",
            k="k_norm.weight" if self.k_norm is not None else "wk.weight",
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            n_local_heads=local,
            head_offset=self.tp_rank * local,
            shared_gain=self.q_norm is not None,
        )

    def head_blocks(self) -> dict[str, tuple[int, int]]:
        """Per-head Muon's blocks (FQNs relative to this module): `(0, head_dim)` for the rows of wq/wk/wv (one
        query or kv head each), `(1, head_dim)` for the columns of wo (its input is the heads, concatenated)."""
        rows = {f"{w}.weight": (0, self.head_dim) for w in ("wq", "wk", "wv")}
        return {**rows, "wo.weight": (1, self.head_dim)}

    def param_inits(self, out: ParamInit) -> dict[str, ParamInit]:
        """torchtitan's init (FQNs relative to this module): the input projections trunc_normal(0.02), wo `out`
        (the block's depth-scaled std), the q/k norms 1."""
        norms = {"q_norm.weight": constant(1.0), "k_norm.weight": constant(1.0)} if self.q_norm is not None else {}
        return {**norms, **{f"{w}.weight": trunc_normal(0.02) for w in ("wq", "wk", "wv")}, "wo.weight": out}


__all__ = ["Attention", "attend", "sdpa"]
