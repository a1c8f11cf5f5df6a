"""Tokenizers: a file-free byte tokenizer (the offline default) and a Hugging Face tokenizer read from its files.

A tokenizer's ``fingerprint`` names exactly what it encodes to; pre-tokenized shards record it, so training
from them with another tokenizer is caught before the model is built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Protocol

import numpy as np

from .errors import DataError

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    fingerprint: str

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def encode_array(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256 and EOS=257. Needs no files and is very fast."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte"

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


def _download_hint(folder: str) -> str:
    """The one command that fills ``folder`` with a Hugging Face tokenizer (scripts/download_hf_assets.py)."""
    return (
        "; get it with: python scripts/download_hf_assets.py --repo_id <the HF repo of your model, e.g. "
        f"meta-llama/Llama-3.1-8B> --assets tokenizer --local_dir {folder or '.'} (the header of "
        "train_configs/llama3_*.toml has the exact command), or use 'byte'"
    )


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A ``tokenizers`` tokenizer from ``tokenizer.json``, with BOS/EOS from its ``tokenizer_config.json`` (or
    ``special_tokens_map.json``) beside it: the tokens the model was trained to see, not a guess.

    ``encode`` adds BOS (when the config names one) and EOS itself; the tokenizer's own post-processor is not
    used, so every document is ``[BOS] text EOS`` whatever the template says.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTok

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(path):
            hint = _download_hint(folder)
            raise DataError(f"{folder}: no tokenizer.json in this folder; point model.tokenizer at one{hint}")
        self.path = path
        try:
            self._tok = _HFTok.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception ("expected ident at line 1 column 2")
            raise DataError(
                f"{path} is not a Hugging Face tokenizer.json (it does not parse: {e}); point model.tokenizer at "
                "the tokenizer.json of a tokenizer (or its folder), or use 'byte'"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        bos, eos, config = self._special_tokens(folder)
        if eos is None:
            raise DataError(f'{config}: no eos_token; documents need one to be packed: add "eos_token": "..."')
        for name in (bos, eos):
            if name is not None and name not in vocab:
                raise DataError(f"{config} names {name!r}, which {path} does not have; fix its bos_token/eos_token")
        self.bos_id = None if bos is None else vocab[bos]
        self.eos_id = vocab[eos]
        # Ids can be sparse; the model's embedding must cover the largest one.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read())
        digest.update(json.dumps([self.bos_id, self.eos_id]).encode())
        self.fingerprint = "sha256:" + digest.hexdigest()[:16]
        logger.info("Loaded tokenizer %s: vocab %d, bos %s, eos %d", path, self.vocab_size, self.bos_id, self.eos_id)

    @staticmethod
    def _special_tokens(folder: str) -> tuple[str | None, str | None, str]:
        """(bos, eos, the file they came from), from the first of the HF config files present."""
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config = os.path.join(folder, name)
            if os.path.isfile(config):
                try:
                    with open(config, encoding="utf-8") as f:
                        data = json.load(f)
                except (OSError, ValueError) as e:
                    raise DataError(f"{config} does not parse as JSON ({e}); fix or remove it") from None
                return _token_name(data.get("bos_token")), _token_name(data.get("eos_token")), config
        raise DataError(
            f"{folder}: no tokenizer_config.json (or special_tokens_map.json) beside tokenizer.json, so BOS/EOS "
            'are unknown; add a tokenizer_config.json with {"bos_token": "...", "eos_token": "..."} (or fetch '
            "the model's with python scripts/download_hf_assets.py --repo_id <the model's HF repo> --assets tokenizer "
            "--local_dir " + (folder or ".") + ")"
        )

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        return np.asarray(self.encode(text, bos, eos), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the byte tokenizer, else a path to ``tokenizer.json`` or to a folder holding one (with its
    ``tokenizer_config.json``). Raises ``DataError`` naming the path when it is not usable."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        norm = os.path.normpath(spec)
        is_file = os.path.basename(norm) == "tokenizer.json"
        if is_file or os.path.basename(os.path.dirname(norm)) == "tokenizer":
            # A Hugging Face tokenizer's file or folder (assets/tokenizer/<name>/): say how to fetch it.
            folder = os.path.dirname(spec) if is_file else spec
            raise DataError(f"tokenizer {'file' if is_file else 'folder'} {spec} is missing{_download_hint(folder)}")
        raise DataError(f"tokenizer {spec!r}: no such file or folder; use 'byte' or the path of a tokenizer.json")
    return HFTokenizer(spec)
