"""Pre-tokenized token shards: the format scripts/prepare_data.py writes and ``training.dataset = "tokens"`` reads.

A folder holds, per split ("train", "val"), shards ``<split>-00000.bin`` (every document's tokens, ``BOS text
EOS``, back to back, as ``uint16`` or ``uint32``) each with ``<split>-00000.idx`` (``int64`` offsets: where
each document starts, then the shard's end), and one ``manifest.json``: format, dtype, tokenizer
(fingerprint, vocab, BOS/EOS), source, val_fraction and, per split, the documents and tokens of each shard.
A reader opens the manifest and ``np.memmap``s a shard only when it reads a document of it, so start-up
time and memory grow with the number of shards, never with the number of documents or tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .errors import DataError

FORMAT = "titan_dmuon.tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id: uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def check_vocab_fits(vocab_size: int, dtype: np.dtype | str, where: str) -> None:
    dtype = np.dtype(dtype)
    if vocab_size > int(np.iinfo(dtype).max) + 1:
        raise DataError(
            f"{where}: token dtype {dtype.name} holds ids below {int(np.iinfo(dtype).max) + 1}, but the tokenizer's "
            f"vocabulary has {vocab_size}; use uint32 (prepare_data.py --dtype uint32, or its default 'auto')"
        )


class ShardWriter:
    """Appends documents of one split to ``<folder>/<split>-NNNNN.bin`` / ``.idx``; a new shard starts when
    the next document would take the current one past ``shard_tokens`` (a document never spans shards)."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._bin = self._idx = None
        self._tokens = 0

    def _open(self) -> None:
        self._close_shard()
        name = f"{self.split}-{len(self.shards):05d}"
        self.shards.append({"name": name, "documents": 0, "tokens": 0})
        self._bin = open(os.path.join(self.folder, name + ".bin"), "wb")
        self._idx = open(os.path.join(self.folder, name + ".idx"), "wb")
        self._idx.write(np.zeros(1, dtype=np.int64).tobytes())
        self._tokens = 0

    def _close_shard(self) -> None:
        if self._bin is not None:
            self._bin.close()
            self._idx.close()
            self._bin = self._idx = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their tokens back to back and each one's length."""
        ends = np.cumsum(lengths, dtype=np.int64)
        begin = 0
        while begin < len(lengths):
            if self._bin is None or (self._tokens > 0 and self._tokens + int(lengths[begin]) > self.shard_tokens):
                self._open()
            base = int(ends[begin - 1]) if begin else 0
            # documents [begin, end) fit in this shard (at least one, even when it alone is larger)
            room = self.shard_tokens - self._tokens + base
            end = max(begin + 1, int(np.searchsorted(ends, room, side="right")))
            stop = int(ends[end - 1])
            self._bin.write(np.ascontiguousarray(tokens[base:stop], dtype=self.dtype).tobytes())
            self._idx.write((ends[begin:end] - base + self._tokens).astype(np.int64).tobytes())
            shard = self.shards[-1]
            shard["documents"] += end - begin
            shard["tokens"] += stop - base
            self._tokens += stop - base
            begin = end

    def close(self) -> dict[str, Any]:
        """The split's manifest entry."""
        self._close_shard()
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }


def write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    """Written last and atomically: a folder without one is an unfinished preparation."""
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **manifest}, f, indent=1)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise DataError(f"{folder} does not exist; make it with scripts/prepare_data.py --output {folder}")
    if not os.path.isfile(path):
        raise DataError(
            f"{folder}: no {MANIFEST}, so not a finished scripts/prepare_data.py output; (re)run prepare_data.py "
            "with --output pointing here"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} does not parse ({e}); re-run scripts/prepare_data.py") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}; re-run prepare_data.py")
    return manifest


def moved_document(manifest: dict[str, Any]) -> tuple[str, str] | None:
    """``(from, to)`` when the last document of split ``from`` belongs to split ``to``: prepare_data.py splits by
    the text hash alone, which on a small corpus can hold out none of the documents (49 at --val-fraction 0.02:
    37% of corpora) or all of them. A ``val_fraction`` in (0, 1) holds out at least one of two or more documents
    and never all, so then the last document of the other split changes side (chosen from the manifest alone:
    the same on every rank, and no second tokenization). None when the split is as prepared."""
    fraction = manifest.get("val_fraction")
    count = {split: manifest["splits"].get(split, {}).get("documents", 0) for split in SPLITS}
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        return None
    if count["val"] == 0 and count["train"] >= 2:
        return ("train", "val")
    if count["train"] == 0 and count["val"] >= 1:
        return ("val", "train")
    return None


class TokenSource:
    """The documents of some splits of a prepare_data folder; a unit is one document, read by memory map.

    Only the manifest is read up front (and each shard's size checked with ``os.stat``); a document's shard
    is found by bisecting the per-shard document counts. When the prepared split holds out none or all of the
    documents, one document changes side (``moved_document``), for this source as for every other.
    """

    def __init__(self, folder: str, splits: tuple[str, ...] = ("train",)):
        self.folder = folder
        self.manifest = read_manifest(folder)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards: list[str] = []
        self._first: list[int] = []  # the first document of each shard this source reads
        counts = []
        for split in splits:
            entry = self.manifest["splits"].get(split, {"documents": 0, "shards": []})
            for shard in entry["shards"]:
                self._check_files(shard)
                self.shards.append(shard["name"])
                self._first.append(0)
                counts.append(shard["documents"])
        self.tokens = sum(self.manifest["splits"].get(s, {}).get("tokens", 0) for s in splits)
        note = ""
        moved = moved_document(self.manifest)
        if moved is not None and (moved[0] in splits) != (moved[1] in splits):
            source, _ = moved
            last = self.manifest["splits"][source]["shards"][-1]
            self._check_files(last)
            idx = os.path.join(folder, last["name"] + ".idx")
            begin, end = np.fromfile(idx, dtype=np.int64, count=2, offset=8 * (last["documents"] - 1))
            length = int(end - begin)
            if source in splits:  # the last document (of the last shard) leaves
                counts[self.shards.index(last["name"])] -= 1
                self.tokens -= length
                note = f", less its last document, held out for the {moved[1]} split"
            else:
                self.shards.append(last["name"])
                self._first.append(last["documents"] - 1)
                counts.append(1)
                self.tokens += length
                note = f", plus the last {source} document, as the prepared {moved[1]} split is empty"
        self.doc_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.description = f"{folder} ({'+'.join(splits)}{note}: {len(self)} documents, {self.tokens} tokens)"
        if len(self) == 0:
            fraction = self.manifest.get("val_fraction")
            if self.manifest.get("documents") == 1 and splits == ("val",):
                raise DataError(
                    f"{folder}: the val split has no documents: one document cannot be split (it stays in the train "
                    f"split; prepared with --val-fraction {fraction}); add documents, or set validation.dataset"
                )
            raise DataError(
                f"{folder}: the {'/'.join(splits)} split has no documents (prepared with --val-fraction {fraction}); "
                "re-run prepare_data.py with a val fraction that holds some out, or set validation.dataset"
            )
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _check_files(self, shard: dict[str, Any]) -> None:
        for suffix, expected in (
            (".bin", shard["tokens"] * self.dtype.itemsize),
            (".idx", (shard["documents"] + 1) * 8),
        ):
            path = os.path.join(self.folder, shard["name"] + suffix)
            if not os.path.isfile(path):
                raise DataError(f"{path} is missing (listed in {MANIFEST}); re-run scripts/prepare_data.py")
            if os.path.getsize(path) != expected:
                raise DataError(
                    f"{path} has {os.path.getsize(path)} bytes, {MANIFEST} says {expected}: truncated or from another "
                    "run; re-run scripts/prepare_data.py"
                )

    def __len__(self) -> int:
        return int(self.doc_starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the shards themselves
        return {**self.__dict__, "_maps": {}}

    def _shard(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        if s not in self._maps:
            base = os.path.join(self.folder, self.shards[s])
            offsets = np.memmap(base + ".idx", dtype=np.int64, mode="r")
            tokens = np.memmap(base + ".bin", dtype=self.dtype, mode="r") if offsets[-1] else np.empty(0, self.dtype)
            self._maps[s] = (offsets, tokens)
        return self._maps[s]

    def documents(self, u: int) -> list[np.ndarray]:
        """Document ``u``'s tokens (a view into the memory map)."""
        s = int(np.searchsorted(self.doc_starts, u, side="right")) - 1
        offsets, tokens = self._shard(s)
        d = self._first[s] + u - int(self.doc_starts[s])
        return [tokens[int(offsets[d]) : int(offsets[d + 1])]]

    def check_tokenizer(self, tokenizer) -> None:
        """The tokens were made by this tokenizer, and its ids fit the dtype."""
        made = self.manifest["tokenizer"]
        if made["fingerprint"] != tokenizer.fingerprint:
            raise DataError(
                f"{os.path.join(self.folder, MANIFEST)}: these tokens were made with tokenizer {made['spec']!r} "
                f"({made['fingerprint']}), but training uses one with fingerprint {tokenizer.fingerprint}; set "
                f"model.tokenizer to {made['spec']!r} or re-run prepare_data.py with this tokenizer"
            )
        check_vocab_fits(tokenizer.vocab_size, self.dtype, os.path.join(self.folder, MANIFEST))
