"""Text generation from a trained model: sampling (greedy, temperature, top-k, top-p) over a batch of prompts of
different lengths with a KV cache (titan_dmuon/components/kv_cache.py), one process or tensor-parallel ranks.

Under TP every rank runs the same loop on the same tokens: the logits come back replicated and the sampler draws
from a generator seeded alike on every rank, so the ranks pick the same tokens without a collective of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    """0: greedy (argmax); else the logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to at least top_p (1.0: all)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> the next token of each row ``[B]``."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@dataclass
class Generated:
    """Each prompt's new tokens (up to, not including, the end-of-sequence token) and the timings."""

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def tokens_per_second(self) -> float:
        """New tokens over the whole time (prompt processing included)."""
        return self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    sampling: Sampling,
    *,
    eos_id: int | None = None,
    device: torch.device | str = "cpu",
) -> Generated:
    """Continue each prompt (token ids) by up to ``sampling.max_new_tokens`` tokens, stopping a row at ``eos_id``.

    ``model(tokens, cache)`` must accept a ``KVCache`` (titan_dmuon/components/kv_cache.py) and hold its blocks in
    ``model.layers``; its RoPE table must cover the longest prompt plus ``max_new_tokens``."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        tokens[row, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
    cache = KVCache(len(model.layers), pad, longest + sampling.max_new_tokens)
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature else None
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)

    start = time.perf_counter()
    logits = model(tokens, cache)[:, -1]
    prefill = time.perf_counter() - start
    for step in range(sampling.max_new_tokens):
        nxt = next_tokens(logits, sampling, generator)
        for row, token in enumerate(nxt.tolist()):
            if not done[row]:
                if token == eos_id:
                    done[row] = True
                else:
                    out[row].append(token)
        if bool(done.all()) or step == sampling.max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache)[:, -1]
    return Generated(out, prefill, time.perf_counter() - start - prefill)
