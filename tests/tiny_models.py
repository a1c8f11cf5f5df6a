"""Tiny models shared by the tests (the quick-start TinyMLP of titan_dmuon.models.tiny_mlp, each layer a module with a
forward)."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_dmuon.models.tiny_mlp import TinyMLP as _SeedTinyMLP
from titan_dmuon.models.tiny_mlp import is_muon_target as proj_predicate  # noqa: F401 (the tests' name for it)


class TinyMLP(_SeedTinyMLP):
    """The quick-start TinyMLP (titan_dmuon.models.tiny_mlp) at test size, with a 4-wide head."""

    def __init__(self, d: int = 32, ff: int = 64, n_layers: int = 3):
        super().__init__(d, ff, n_layers, n_out=4)


def batch(step: int, rank: int, b: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(b, d, generator=g)


class Attention(nn.Module):
    """Causal self-attention; head count taken from the (possibly TP-sharded) projection width."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.head_dim = d // n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, d: int, ff: int, n_heads: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.self_attn = Attention(d, n_heads)
        self.mlp_norm = nn.RMSNorm(d)
        self.mlp = MLP(d, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """Two llama-style blocks on float inputs (B, T, d); loss = mean square of a small head."""

    def __init__(self, d: int = 32, ff: int = 64, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([LlamaBlock(d, ff, n_heads) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).pow(2).mean()


def apply_llama_tp(model: TinyLlama, tp_mesh, mlp: bool = True) -> None:
    """Megatron-style TP: q/k/v and gate/up column-wise, o and down row-wise (`mlp=False`: the MLPs stay plain,
    whole on every TP rank, fed the replicated activations)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers:
        parallelize_module(
            block.self_attn,
            tp_mesh,
            {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(),
            },
        )
        if not mlp:
            continue
        parallelize_module(
            block.mlp,
            tp_mesh,
            {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
        )


def seq_batch(step: int, rank: int, b: int, t: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(b, t, d, generator=g)
