"""The key/value cache of generation: each layer's keys and values of the tokens seen so far, so a decode step
runs the model on the new token only.

A batch of prompts of different lengths is left-padded to one length: row ``b``'s first ``pad[b]`` slots hold no
token. Its positions (RoPE) count from its first real token, and no query attends to a padded slot, so each row
computes what it would alone. The cache is model-agnostic: a model asks it for the step's positions
(``begin``), hands each attention layer its ``LayerCache``, and calls ``advance`` after the step.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys ``[B, max_len, kv_heads, k_dim]`` and values ``[B, max_len, kv_heads, v_dim]``,
    each allocated at the first step with that step's dtype, device, (TP-local) head count and width of its own
    (multi-head latent attention caches its latent as the key and its narrower rotary key as the value)."""

    def __init__(self, owner: KVCache) -> None:
        self._owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store this step's ``k, v [B, L, H, D]``; return every cached key and value so far and the step's
        boolean attention mask ``[B, 1, L, T]`` (True: attend)."""
        owner = self._owner
        if self.k is None:
            self.k = k.new_empty(k.shape[0], owner.max_len, *k.shape[2:])
            self.v = v.new_empty(v.shape[0], owner.max_len, *v.shape[2:])
        start, end = owner.length, owner.length + k.shape[1]
        self.k[:, start:end], self.v[:, start:end] = k, v
        return self.k[:, :end], self.v[:, :end], owner.mask


class KVCache:
    """Every layer's cache for ``pad.numel()`` sequences of at most ``max_len`` slots (padding included)."""

    def __init__(self, n_layers: int, pad: torch.Tensor, max_len: int) -> None:
        self.pad = pad.long()
        self.max_len = max_len
        self.length = 0  # slots filled so far, padding included
        self.mask: torch.Tensor | None = None
        self._layers = [LayerCache(self) for _ in range(n_layers)]

    def layer(self, i: int) -> LayerCache:
        return self._layers[i]

    def begin(self, n: int) -> torch.Tensor:
        """Start a step of ``n`` new slots: fix its attention mask and return each row's positions ``[B, n]``.

        Slot ``j`` is visible to the query in slot ``i`` when ``pad[b] <= j <= i``; a padded query sees itself
        only, so its softmax has a term (its output is never used)."""
        if self.length + n > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} slots: {self.length} used, {n} more asked")
        device = self.pad.device
        query = torch.arange(self.length, self.length + n, device=device)
        key = torch.arange(self.length + n, device=device)
        causal = key[None, :] <= query[:, None]  # [n, T]
        real = key[None, :] >= self.pad[:, None]  # [B, T]
        self.mask = ((causal[None] & real[:, None]) | (key[None, :] == query[:, None])[None]).unsqueeze(1)
        return (query[None, :] - self.pad[:, None]).clamp(min=0)

    def advance(self, n: int) -> None:
        self.length += n


def run_blocks(blocks, h: torch.Tensor, rope: torch.Tensor, n_tokens: int, cache: KVCache | None) -> torch.Tensor:
    """A model's blocks over `h` (the embeddings of `n_tokens` new tokens): with RoPE table `rope` in training,
    or, with a `cache`, at each row's own positions, each block with its layer's cache, then the cache advanced.

    Training calls a block with (h, rope) only, so its hooks (FSDP2's casts, AC, TP) see what they always did."""
    if cache is not None:
        rope = rope[cache.begin(n_tokens)]
    for i, block in enumerate(blocks):
        h = block(h, rope) if cache is None else block(h, rope, cache.layer(i))
    if cache is not None:
        cache.advance(n_tokens)
    return h
