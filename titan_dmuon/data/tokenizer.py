"""Tokenizers: a file-free byte tokenizer (the offline default) and a wrapper over a HF ``tokenizer.json``."""

from __future__ import annotations

import logging
import os
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256 and EOS=257. Needs no files and is very fast."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode_array(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        """The tokens as an int64 array (the data pipeline's fast path)."""
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(len(body) + bos + eos, dtype=np.int64)
        out[int(bos) : int(bos) + len(body)] = body
        if bos:
            out[0] = self.bos_id
        if eos:
            out[-1] = self.eos_id
        return out

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return self.encode_array(text, bos, eos).tolist()

    def decode(self, ids) -> str:
        """Special tokens are dropped; invalid UTF-8 (e.g. a window cut mid-character) becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# Special-token spellings tried in order when looking for BOS/EOS in a tokenizer.json.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|endoftext|>")


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json`` (a file, or a directory holding one).

    BOS/EOS are found among its special tokens by their usual spellings; the BOS/EOS flags of ``encode``
    add them explicitly (the tokenizer's own post-processor is not used).
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTok

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self.path = path
        self._tok = _HFTok.from_file(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self.bos_id = self._find(vocab, special, _BOS_NAMES, "BOS")
        self.eos_id = self._find(vocab, special, _EOS_NAMES, "EOS")
        # Ids can be sparse; the model's embedding must cover the largest one.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        logger.info("Loaded tokenizer %s: vocab %d, bos %d, eos %d", path, self.vocab_size, self.bos_id, self.eos_id)

    def _find(self, vocab: dict[str, int], special: set[str], names: tuple[str, ...], what: str) -> int:
        for name in names:
            if name in special and name in vocab:
                return vocab[name]
        for name in names:  # fall back to a non-special token with the right spelling
            if name in vocab:
                return vocab[name]
        raise ValueError(f"{self.path}: no {what} token found (looked for {', '.join(names)})")

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        return np.asarray(self.encode(text, bos, eos), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the byte tokenizer, else a path to ``tokenizer.json`` or to a directory holding it."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise FileNotFoundError(f"tokenizer {spec!r}: not 'byte' and no such file or directory")
    return HFTokenizer(spec)
