"""Tokenizers: a file-free byte tokenizer (the offline default) and a Hugging Face tokenizer read from its files.

A tokenizer's ``fingerprint`` names exactly what it encodes to; pre-tokenized shards record it, so training
from them with another tokenizer is caught before the model is built. ``save_hf(folder)`` writes either one as
Hugging Face tokenizer files (what a Hugging Face export puts beside the weights,
titan_dmuon/components/checkpoint/hf_io.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Protocol

import numpy as np

from .errors import DataError

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    """The id a Hugging Face export names as padding (config.json's pad_token_id); training never pads."""
    fingerprint: str

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def encode_array(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray: ...

    def decode(self, ids: list[int]) -> str: ...

    def save_hf(self, folder: str | os.PathLike) -> list[Path]: ...


# The byte tokenizer's special tokens as its Hugging Face form spells them (Llama 3's names).
BYTE_BOS, BYTE_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Files of a Hugging Face tokenizer (never weights or a model's config.json): what HFTokenizer.save_hf copies.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)


def _byte_chars() -> list[str]:
    """The printable character standing for each byte 0..255 in a byte-level BPE vocabulary (the ByteLevel
    pre-tokenizer's alphabet): printable Latin-1 bytes stand for themselves, the 68 others (controls, space,
    DEL, NBSP, soft hyphen) for U+0100 onwards, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + shifted))
            shifted += 1
    return out


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256 and EOS=257. Needs no files and is very fast."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    pad_id = 257  # no padding token of its own: EOS, as Hugging Face exports of Llama do
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

    def save_hf(self, folder: str | os.PathLike) -> list[Path]:
        """Write this tokenizer as Hugging Face files in `folder`: ``tokenizer.json`` (a byte-level BPE without
        merges whose token i is byte i, BOS 256 and EOS 257 as special tokens), ``tokenizer_config.json`` and
        ``special_tokens_map.json``. ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer`` load
        them; their encoding is ``encode(text, bos=True, eos=False)``, the prompt a generation starts from (EOS is
        for the model to produce), and their decoding with ``skip_special_tokens`` is ``decode``'s (U+FFFD for
        invalid UTF-8 included). PAD is EOS. A text holding the literal string ``<|begin_of_text|>`` encodes as
        its bytes, like ours, under transformers (``split_special_tokens``); plain ``tokenizers`` needs
        ``tok.encode_special_tokens = True`` for that (the setting is not stored in tokenizer.json)."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as _HFTok

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        vocab = {c: b for b, c in enumerate(_byte_chars())}
        tok = _HFTok(models.BPE(vocab=vocab, merges=[]))
        # no regex split: the bytes of the whole text, each one token (there are no merges to bound)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BYTE_BOS, BYTE_EOS)])
        ids = tok.get_vocab(with_added_tokens=True)
        if (ids[BYTE_BOS], ids[BYTE_EOS], tok.get_vocab_size(True)) != (self.bos_id, self.eos_id, self.vocab_size):
            raise RuntimeError(f"the byte tokenizer's HF form has ids {ids[BYTE_BOS]}, {ids[BYTE_EOS]}: not ours")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BYTE_BOS} $A",
            pair=f"{BYTE_BOS} $A {BYTE_BOS}:1 $B:1",
            special_tokens=[(BYTE_BOS, self.bos_id), (BYTE_EOS, self.eos_id)],
        )
        tok.save(str(folder / "tokenizer.json"))
        special = {"bos_token": BYTE_BOS, "eos_token": BYTE_EOS, "pad_token": BYTE_EOS}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,  # decode returns the bytes' text, spaces untouched
            "split_special_tokens": True,  # "<|end_of_text|>" in a text is 15 bytes, as ours encodes it
        }
        _write_json(folder / "tokenizer_config.json", config)
        _write_json(folder / "special_tokens_map.json", special)
        return [folder / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]


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
        self.folder = folder
        vocab = self._tok.get_vocab(with_added_tokens=True)
        bos, eos, pad, config = self._special_tokens(folder)
        if eos is None:
            raise DataError(f'{config}: no eos_token; documents need one to be packed: add "eos_token": "..."')
        for name in (bos, eos):
            if name is not None and name not in vocab:
                raise DataError(f"{config} names {name!r}, which {path} does not have; fix its bos_token/eos_token")
        self.bos_id = None if bos is None else vocab[bos]
        self.eos_id = vocab[eos]
        # The config's pad token when the vocabulary has it (only an export names it), else EOS.
        self.pad_id = vocab.get(pad, self.eos_id) if pad is not None else self.eos_id
        # Ids can be sparse; the model's embedding must cover the largest one.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read())
        digest.update(json.dumps([self.bos_id, self.eos_id]).encode())
        self.fingerprint = "sha256:" + digest.hexdigest()[:16]
        logger.info("Loaded tokenizer %s: vocab %d, bos %s, eos %d", path, self.vocab_size, self.bos_id, self.eos_id)

    @staticmethod
    def _special_tokens(folder: str) -> tuple[str | None, str | None, str | None, str]:
        """(bos, eos, pad, the file they came from), from the first of the HF config files present."""
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config = os.path.join(folder, name)
            if os.path.isfile(config):
                try:
                    with open(config, encoding="utf-8") as f:
                        data = json.load(f)
                except (OSError, ValueError) as e:
                    raise DataError(f"{config} does not parse as JSON ({e}); fix or remove it") from None
                names = (_token_name(data.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
                return (*names, config)
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

    def save_hf(self, folder: str | os.PathLike) -> list[Path]:
        """Copy the tokenizer files this tokenizer was read from into `folder`: its tokenizer.json (under that
        name) and the other Hugging Face tokenizer files beside it (``HF_TOKENIZER_FILES``: configs, vocab and
        merges files, sentencepiece models, chat templates; never weights or config.json), unchanged. The copies
        get the mode a new file gets (not the source's: a read-only cache stays read-only there only)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        sources = {"tokenizer.json": Path(self.path)}
        for name in HF_TOKENIZER_FILES:
            path = Path(self.folder or ".") / name
            if name not in sources and path.is_file():
                sources[name] = path
        written = []
        for name, path in sources.items():
            shutil.copyfile(path, folder / name)
            written.append(folder / name)
        return written


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the byte tokenizer, else a path to ``tokenizer.json`` or to a folder holding one (with its
    ``tokenizer_config.json``). Raises ``DataError`` naming the path when it is not usable."""
    if spec == "byte":
        return ByteTokenizer()
    check_tokenizer_path(spec)
    return HFTokenizer(spec)


def check_tokenizer_path(spec: str) -> None:
    """``DataError`` naming ``spec`` (and how to fetch a Hugging Face tokenizer) when it is neither "byte" nor an
    existing path: the cheap half of `build_tokenizer`, run before a launch's start-up."""
    if spec == "byte" or os.path.exists(spec):
        return
    norm = os.path.normpath(spec)
    is_file = os.path.basename(norm) == "tokenizer.json"
    if is_file or os.path.basename(os.path.dirname(norm)) == "tokenizer":
        # A Hugging Face tokenizer's file or folder (assets/tokenizer/<name>/): say how to fetch it.
        folder = os.path.dirname(spec) if is_file else spec
        raise DataError(f"tokenizer {'file' if is_file else 'folder'} {spec} is missing{_download_hint(folder)}")
    raise DataError(f"tokenizer {spec!r}: no such file or folder; use 'byte' or the path of a tokenizer.json")
