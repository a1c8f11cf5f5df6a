"""The residual MLP: the quick-start model (TinyMLP) and its token-level variant the trainer trains (TinyMLPLM).

TinyMLP is the one definition for the quick-start example, the step benchmark and the DMuon tests. Its matrices
are named `*_proj` (the quick start's Muon predicate: `"proj" in name and p.ndim == 2`); the loss is a mean, so
per-rank losses average like one concatenated batch.

TinyMLPLM puts the same blocks between a token embedding and an output head: a language model with no
attention (each position sees only its own token), small and quick to train, with the model contract
titan_dmuon/components/model.py describes (meta build, `init_weights`, tokens in, logits out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_dmuon.components.initialization import ParamInit, constant, init_params, normal, uniform


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


@dataclass
class TinyMLPArgs:
    dim: int = 256
    ff: int = 1024
    n_layers: int = 4
    vocab_size: int = -1  # set from the tokenizer


class TinyMLPLM(nn.Module):
    """Token embedding -> residual MLP blocks -> LayerNorm -> output head: tokens [B, T] -> logits [B, T, V]."""

    def __init__(self, args: TinyMLPArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(f"TinyMLPArgs.vocab_size must be set (> 0), got {args.vocab_size}")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Block(args.dim, args.ff) for _ in range(args.n_layers)])
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """Every parameter's initial distribution by FQN: the embedding N(0, 1), each Linear weight
        U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear's default), LayerNorms 1 and 0."""
        inits: dict[str, ParamInit] = {"tok_embeddings.weight": normal(1.0)}
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, nn.Linear):
                bound = module.in_features**-0.5
                inits[f"{prefix}weight"] = uniform(-bound, bound)
            elif isinstance(module, nn.LayerNorm):
                inits.update({f"{prefix}weight": constant(1.0), f"{prefix}bias": constant(0.0)})
        return inits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize an unsharded, materialized model in place from `param_inits`, with the seed of
        `torch.manual_seed` (`torch.initial_seed()`); there are no buffers."""
        init_params(self, self.param_inits(), torch.initial_seed())

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n
