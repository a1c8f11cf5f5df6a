"""Llama 3 decoder-only transformer: its arguments and its block, on the shared core (titan_dmuon/models/common/).

A block is grouped-query attention with RoPE on Meta's interleaved pairs (dimensions 2i and 2i + 1 of a head: the
layout of Meta's checkpoints; the Hugging Face adapter permutes q/k rows) and a SwiGLU whose width follows the
Llama rule (`ModelArgs.ffn_hidden_dim`). The output head is never tied. No parallelism code: see
common/tensor_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_dmuon.models.common.attention import Attention
from titan_dmuon.models.common.block import TransformerBlock, depth_init_std
from titan_dmuon.models.common.decoder import Decoder, get_nparams_and_flops
from titan_dmuon.models.common.feed_forward import FeedForward


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


def build_block(layer_id: int, args: ModelArgs) -> TransformerBlock:
    """Block ``layer_id``: GQA with interleaved RoPE, then the SwiGLU; torchtitan's depth-scaled init."""
    attention = Attention(args.dim, args.n_heads, args.kv_heads, args.head_dim, rope_layout="interleaved")
    feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
    init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)
    return TransformerBlock(layer_id, args.dim, args.norm_eps, attention, feed_forward, init_std)


class Transformer(Decoder):
    """Llama 3: the shared decoder with Llama's blocks (FQNs `tok_embeddings`, `layers.N....`, `norm`, `output`)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, build_block)


__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "build_block", "get_nparams_and_flops"]
