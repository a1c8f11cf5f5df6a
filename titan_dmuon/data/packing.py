"""The global batch order, and one DP rank's share of it as packed ``seq_len + 1`` token windows.

A global batch has ``B`` rows (``B = local_batch_size x DP ranks x gradient accumulation``). Row ``j`` is a
packing stream of its own: it reads the units (documents, or byte ranges / files / row groups of a raw
source) at positions ``j, j + B, j + 2B, ...`` of the endless sequence of epochs, where epoch ``e`` visits
every unit once in a seeded pseudo-random order (``Permutation``: O(1) memory, any corpus size), and it cuts
the concatenation of those documents (each ``BOS text EOS``) into windows of ``seq_len + 1`` tokens with
stride ``seq_len``: consecutive windows of a row share one token, so every token is a label once. Global
batch ``k`` is window ``k`` of every row. That is a function of (seed, dataset, B, seq_len) only: DP rank
``r`` of ``N`` takes rows ``r, r + N, r + 2N, ...``, reads only the units of those rows, and the same step
of any cluster shape holds the same windows (4 ranks x 8, 2 x 16 and 1 x 32 train on identical batches).

The dataset yields one item per step: the windows of the rank's ``R`` rows, ``[R, seq_len + 1]``. With
DataLoader workers, worker ``w`` of ``W`` packs the rows ``w, w + W, ...`` (so every row is read and
tokenized by one process only) and yields their windows each step; ``interleave`` puts a step's ``W`` items
back in row order. The state (the next step, each row's position) is a few integers per row, so a
``StatefulDataLoader`` resumes exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .errors import DataError


class Permutation:
    """A seeded pseudo-random permutation of ``range(n)``, evaluated one index at a time in O(1) memory.

    A 4-round Feistel network on the smallest even number of bits that covers ``n``, with cycle walking
    (apply again until the value falls below ``n``; fewer than 4 rounds of walking on average): a bijection
    by construction, so every epoch visits every unit exactly once without an n-entry array on every rank.
    """

    def __init__(self, n: int, seed: Sequence[int]):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        self.keys = [int(k) for k in np.random.default_rng(list(seed)).integers(0, 2**32, size=4)]

    def _round(self, x: int, key: int) -> int:
        x = (x ^ key) & 0xFFFFFFFF  # lowbias32, a well-mixing 32-bit integer hash
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        x ^= x >> 16
        return x & self.mask

    def __call__(self, i: int) -> int:
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ self._round(right, key)
            x = (left << self.half) | right
            if x < self.n:
                return x


class GlobalOrder:
    """The unit that row ``j`` of ``B`` reads at its ``k``-th position: position ``p = j + k * B`` of the
    endless sequence of epochs, epoch ``p // U`` in its own seeded order (or source order unshuffled)."""

    def __init__(self, num_units: int, global_batch_size: int, seed: int, shuffle: bool = True):
        self.num_units, self.global_batch_size, self.seed, self.shuffle = num_units, global_batch_size, seed, shuffle
        self._perms: dict[int, Permutation] = {}

    def unit(self, row: int, k: int) -> int:
        epoch, i = divmod(row + k * self.global_batch_size, self.num_units)
        if not self.shuffle:
            return i
        if epoch not in self._perms:
            if len(self._perms) >= 64:  # rows of one rank are at most a few epochs apart
                self._perms.pop(min(self._perms))
            self._perms[epoch] = Permutation(self.num_units, (self.seed, epoch))
        return self._perms[epoch](i)


class RowReader:
    """One row's packing stream: where its next window starts (its ``k``-th unit, document ``doc`` of it,
    token ``offset`` of that), and the current unit's documents and document's tokens, cached."""

    def __init__(self, source, tokenizer, order: GlobalOrder, row: int, seq_len: int, state: Sequence[int]):
        self.source, self.tokenizer, self.order, self.row, self.seq_len = source, tokenizer, order, row, seq_len
        self.k, self.doc, self.offset = (int(v) for v in state)
        self._docs: tuple[int, list] | None = None
        self._toks: tuple[int, int, np.ndarray] | None = None

    @property
    def state(self) -> list[int]:
        return [self.k, self.doc, self.offset]

    def _documents(self, k: int) -> list:
        if self._docs is None or self._docs[0] != k:
            self._docs = (k, self.source.documents(self.order.unit(self.row, k)))
        return self._docs[1]

    def _tokens(self, k: int, d: int) -> np.ndarray:
        if self._toks is None or self._toks[:2] != (k, d):
            doc = self._documents(k)[d]
            toks = self.tokenizer.encode_array(doc, bos=True, eos=True) if isinstance(doc, str) else doc
            self._toks = (k, d, toks)
        return self._toks[2]

    def window(self) -> np.ndarray:
        """The next ``seq_len + 1`` tokens; the next window starts at this one's last token."""
        size = self.seq_len + 1
        out = np.empty(size, dtype=np.int64)
        n, (k, d, o) = 0, self.state
        idle, limit = 0, 4 * self.order.num_units + 64
        while True:
            if d >= len(self._documents(k)):
                k, d, o, idle = k + 1, 0, 0, idle + 1
                if idle > limit:
                    raise DataError(
                        f"row {self.row} read {idle} units in a row without a document: {self.source.description} "
                        "has too few documents in this split for the global batch"
                    )
                continue
            toks = self._tokens(k, d)
            take = min(size - n, len(toks) - o)
            out[n : n + take] = toks[o : o + take]
            n, idle = n + take, 0
            if n == size:
                self.k, self.doc, self.offset = k, d, o + take - 1
                return out
            d, o = d + 1, 0


def interleave(items: Sequence[np.ndarray]) -> np.ndarray:
    """One step's windows in row order from its ``W`` workers' items (worker ``w`` holds rows ``w, w + W, ...``)."""
    if len(items) == 1:
        return items[0]
    rows = sum(len(item) for item in items)
    return np.stack([items[i % len(items)][i // len(items)] for i in range(rows)])


class PackedDataset(IterableDataset):
    """DP rank ``dp_rank``'s rows of the global batches: per step, an int64 array ``[rows, seq_len + 1]`` of
    windows (``inputs = w[:, :-1]``, ``labels = w[:, 1:]``), or a worker's share of them (see ``interleave``).
    Arrays, not tensors: from a worker they travel as plain bytes, cheaper than a shared-memory tensor each.

    ``state_dict`` / ``load_state_dict`` hold every row's position and the next step. ``restart_on_iter``
    (validation) starts from the beginning on every ``iter`` unless a state was just loaded, so every
    evaluation sees the same batches; otherwise the stream continues where it stopped.
    """

    def __init__(
        self,
        source,
        tokenizer,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        restart_on_iter: bool = False,
    ):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_world_size})")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch_size < 1 or global_batch_size % dp_world_size:
            raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of {dp_world_size} DP ranks")
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.global_batch_size, self.dp_rank, self.dp_world_size = global_batch_size, dp_rank, dp_world_size
        self.order = GlobalOrder(len(source), global_batch_size, seed, shuffle)
        self.rows = [dp_rank + dp_world_size * i for i in range(global_batch_size // dp_world_size)]
        self.restart_on_iter = restart_on_iter
        self._resume = False
        self._reset()

    def _reset(self) -> None:
        self._step = 0
        self._readers = [
            RowReader(self.source, self.tokenizer, self.order, j, self.seq_len, (0, 0, 0)) for j in self.rows
        ]

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.restart_on_iter and not self._resume:
            self._reset()
        self._resume = False
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        mine = self._readers[worker::workers]
        while True:
            windows = [reader.window() for reader in mine]
            self._step += 1
            yield np.stack(windows) if windows else np.empty((0, self.seq_len + 1), dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "rows": [r.state for r in self._readers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["rows"]) != len(self.rows):
            raise ValueError(f"the state has {len(state['rows'])} rows, this rank has {len(self.rows)}")
        self._step = int(state["step"])
        self._readers = [
            RowReader(self.source, self.tokenizer, self.order, j, self.seq_len, s)
            for j, s in zip(self.rows, state["rows"], strict=True)
        ]
        self._resume = True
