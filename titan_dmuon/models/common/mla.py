"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight, Kimi K2; HF's DeepseekV3Attention), without
parallelism code.

Keys and values come from one low-rank latent per token: `wkv_a` maps x to the latent (``kv_lora_rank``) and one
rotary key (``qk_rope_head_dim``) shared by every head; `kv_norm` normalizes the latent and `wkv_b` expands it into
each head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``). Queries come from `wq` or, with
``q_lora_rank``, from their own low-rank path (`wq_a`, `q_norm`, `wq_b`); each head's query is its non-rotary part
followed by its rotary part. A head's logit is q_nope·k_nope + q_rope·k_rope, times ``softmax_scale``.

RoPE pairs the rotary dimensions as Meta's interleaved layout (2i, 2i + 1): HF's ``rope_interleave`` (the DeepSeek
checkpoints' layout), so the weights are HF's tensors row for row. HF rotates into the rotate_half order (evens then
odds), we keep the pairs in place: the same permutation of q's and k's rotary dims, so the same logits.

Generation caches the latent and the rotary key (``kv_lora_rank + qk_rope_head_dim`` per token, not per head: the
latent cache) in the model-agnostic `LayerCache` (as a one-head key and value) and expands them at each step.

Under tensor parallelism (tensor_parallel.py's `mla_attention_plan`) `wq`/`wq_b`, `wkv_b` are column-parallel (each
rank its heads) and `wo` row-parallel; the low-rank down projections and their norms are whole on every TP rank, fed
the whole sequence. `rope_key` is an identity the plan hooks: the shared rotary key meets only this rank's heads, so
its grad is summed over the TP group there (the latent's grad is summed by `wkv_b`'s column-parallel input).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, trunc_normal
from titan_dmuon.components.kv_cache import LayerCache
from titan_dmuon.dmuon.qk_clip import QKHeads, report_max_logit

from .attention import sdpa
from .norms import RMSNorm
from .rope import apply_rope


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring). FQNs: `wq` (or `wq_a`, `q_norm`, `wq_b`), `wkv_a`,
    `kv_norm`, `wkv_b`, `wo`. Reports its max logits to QK-clip as `Attention` does (`qk_heads`, `max_logit`).

    The latents' norms take ``latent_norm_eps``, 1e-6 by default whatever the blocks' norms use: HF's (and
    DeepSeek's reference code's) q_a_layernorm and kv_a_layernorm are built with their default eps, and Moonlight's
    rms_norm_eps is 1e-5."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        latent_norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.n_heads = self.n_kv_heads = n_heads  # every head has its own key (the rotary part is shared)
        self.tp_rank, self.tp_size = 0, 1
        self.max_logit: torch.Tensor | None = None
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = softmax_scale
        if q_lora_rank > 0:
            self.wq = None
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps=latent_norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=latent_norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.rope_key = nn.Identity()  # where the TP plan sums the shared rotary key's grad over the TP group

    @property
    def q_proj(self) -> str:
        """The per-head query projection: `wq_b` with a query latent, else `wq`."""
        return "wq" if self.wq is not None else "wq_b"

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rot = q.view(bs, seqlen, -1, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, rope, "interleaved")], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent).unsqueeze(2)  # [B, L, 1, kv_lora_rank]
        k_rot = self.rope_key(apply_rope(k_rot.unsqueeze(2), rope, "interleaved"))  # [B, L, 1, rope]
        mask = None
        if cache is not None:  # the latent cache: every position's latent and rotary key so far
            latent, k_rot, mask = cache.update(latent, k_rot)
        kv = self.wkv_b(latent.squeeze(2))
        k_nope, v = kv.view(bs, kv.shape[1], -1, self.nope + self.v_head_dim).split([self.nope, self.v_head_dim], -1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.max_logit is not None and cache is None:
            report_max_logit(self, q, k, self.softmax_scale)
        out = sdpa(q, k, v, mask, self.softmax_scale)
        return self.wo(out.reshape(bs, seqlen, -1))

    def qk_heads(self) -> QKHeads:
        """QK-clip's view (docs/dmuon.md, "QK-clip"): a head's query rows (non-rotary sqrt(gamma), rotary gamma) in
        the query projection, its key rows (non-rotary sqrt(gamma), values untouched) in `wkv_b`; the shared
        rotary key in `wkv_a` stays."""
        local = self.n_heads // self.tp_size
        return QKHeads(
            q=f"{self.q_proj}.weight",
            k="wkv_b.weight",
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            head_dim=self.qk_head_dim,
            n_local_heads=local,
            head_offset=self.tp_rank * local,
            q_rows=((self.nope, 0.5), (self.rope, 1.0)),
            k_rows=((self.nope, 0.5), (self.v_head_dim, 0.0)),
        )

    def head_blocks(self) -> dict[str, tuple[int, int]]:
        """Per-head Muon's blocks (FQNs relative to this module): a head's rows of the query projection and of
        `wkv_b`, its columns of `wo`. The down projections mix every head: whole matrices."""
        return {
            f"{self.q_proj}.weight": (0, self.qk_head_dim),
            "wkv_b.weight": (0, self.nope + self.v_head_dim),
            "wo.weight": (1, self.v_head_dim),
        }

    def param_inits(self, out: ParamInit) -> dict[str, ParamInit]:
        """torchtitan's init (FQNs relative to this module): the projections trunc_normal(0.02), `wo` `out` (the
        block's depth-scaled std), the norms 1."""
        inits = {
            f"{w}.weight": trunc_normal(0.02)
            for w in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")
            if getattr(self, w) is not None
        }
        norms = {f"{n}.weight": constant(1.0) for n in ("q_norm", "kv_norm") if getattr(self, n) is not None}
        return {**inits, **norms, "wo.weight": out}


__all__ = ["MLAttention"]
