"""Llama-3 decoder-only transformer, without any parallelism code.

Parallelism (TP, FSDP2, DMuon) is applied from outside by FQN: see ``tensor_parallel.py``. The model is built on
the meta device and parallelized there; each rank then materializes and initializes only its share, from the
per-FQN distributions ``param_inits`` declares (titan_dmuon/components/initialization.py), so nothing here may depend
on parameter values at construction time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, init_params, normal, trunc_normal
from titan_dmuon.components.kv_cache import KVCache, LayerCache, run_blocks


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads (plain multi-head attention)
    vocab_size: int = -1  # set from the tokenizer for the debug flavor
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048  # length of the precomputed RoPE table; the trainer sets it to its seq_len
    depth_init: bool = True  # torchtitan: output-projection init std shrinks with the layer index

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The Llama rule: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"ModelArgs.vocab_size must be set (> 0), got {self.vocab_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Return the RoPE table ``[max_seq_len, head_dim // 2, 2]`` holding (cos, sin) per position and pair.

    Real-valued rather than complex so that meta-device construction, ``to_empty`` and ``torch.compile``
    need no complex support.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (Meta's interleaved layout) of ``x [B, L, H, D]`` by the table ``rope``: positions
    ``0..L-1`` of the table ``[max_seq_len, D // 2, 2]``, or each row's own positions ``[B, L, D // 2, 2]`` (a
    KV-cached decode step, left-padded prompts)."""
    b, seqlen, h, d = x.shape
    xr = x.float().reshape(b, seqlen, h, d // 2, 2)
    if rope.dim() == 4:
        cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)
    else:
        cos = rope[:seqlen, :, 0].view(1, seqlen, 1, d // 2)
        sin = rope[:seqlen, :, 1].view(1, seqlen, 1, d // 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm written with elementwise ops and a last-dim mean, so it runs on sequence-sharded DTensors."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    """Grouped-query attention. Head counts come from the projections' (possibly TP-sharded) output
    width via ``view(..., -1, head_dim)``, so the same code runs with n_heads // tp local heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads  # invariant under TP: q and kv heads shard alike
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        mask = None
        if cache is not None:  # generation: attend to every cached position the mask allows
            k, v, mask = cache.update(k, v)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm block; a module with its own forward so FSDP2/DMuon hooks can attach at ``layers.N``."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        normed = self.attention_norm(x)
        h = x + (self.attention(normed, rope) if cache is None else self.attention(normed, rope, cache))
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """This block's params (FQNs relative to the block): norms 1, the input projections (wq wk wv w1)
        trunc_normal(0.02), the others (wo w2 w3) trunc_normal with the depth-scaled std (torchtitan's init)."""
        scaled = trunc_normal(self.weight_init_std)
        return {
            "attention_norm.weight": constant(1.0),
            "ffn_norm.weight": constant(1.0),
            **{f"attention.{w}.weight": trunc_normal(0.02) for w in ("wq", "wk", "wv")},
            "attention.wo.weight": scaled,
            "feed_forward.w1.weight": trunc_normal(0.02),
            "feed_forward.w2.weight": scaled,
            "feed_forward.w3.weight": scaled,
        }


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" (torchtitan): FQNs stay `layers.N...` even if layers are dropped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "rope_cache", precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """``tokens [B, L]`` (int64) -> logits ``[B, L, vocab_size]`` in the compute dtype.

        With a ``cache`` (generation), ``tokens`` continue the cached sequences: row ``b``'s positions start at
        ``cache.length - cache.pad[b]`` (its prompt is left-padded by ``pad[b]`` slots that no query sees)."""
        end = tokens.shape[1] if cache is None else cache.length + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}")
        h = run_blocks(self.layers.values(), self.tok_embeddings(tokens), self.rope_cache, tokens.shape[1], cache)
        return self.output(self.norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """Every parameter's initial distribution by FQN (a function of the shapes only: no values read)."""
        std = self.args.dim**-0.5
        inits = {"tok_embeddings.weight": normal(1.0), "norm.weight": constant(1.0)}
        for i, layer in self.layers.items():
            inits.update({f"layers.{i}.{k}": v for k, v in layer.param_inits().items()})
        inits["output.weight"] = trunc_normal(std, a=-3.0 * std, b=3.0 * std)
        return inits

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the buffers (the RoPE table) on `device`; they hold no parameters, so every rank computes all."""
        with torch.device(device):
            self.rope_cache = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize an unsharded, materialized model in place (after ``to_empty``): the buffers, and every
        parameter from ``param_inits`` with the seed of ``torch.manual_seed`` (``torch.initial_seed()``), so
        ``manual_seed(s); init_weights()`` gives the weights a sharded run with seed ``s`` starts from."""
        self.init_buffers(buffer_device if buffer_device is not None else self.rope_cache.device)
        init_params(self, self.param_inits(), torch.initial_seed())

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Global parameter count (DTensor ``numel`` is global, so this holds after TP/FSDP too)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (torchtitan/PaLM convention): 6 * non-embedding params for the matmuls
        (forward + backward) plus 12 * layers * heads * head_dim * seq_len for attention scores/values."""
        a = self.args
        return 6 * self.num_params(exclude_embedding=True) + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def get_nparams_and_flops(model: Transformer, seq_len: int) -> tuple[int, int]:
    """``(total params, training FLOPs per token)`` for MFU reporting."""
    return model.num_params(), model.num_flops_per_token(seq_len)


__all__ = [
    "ModelArgs",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "precompute_rope",
    "apply_rope",
    "get_nparams_and_flops",
]
