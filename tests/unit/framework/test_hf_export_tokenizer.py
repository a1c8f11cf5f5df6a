"""The tokenizers' Hugging Face form (`save_hf`) and what `export_hf` writes beside the weights.

The byte tokenizer's files, loaded by the `tokenizers` library and by transformers' AutoTokenizer, must encode
every text to the ids `ByteTokenizer.encode(text, bos=True, eos=False)` gives (the reference: its own numpy
path, no shared code) and decode any ids (invalid UTF-8, special tokens inside) to `ByteTokenizer.decode`'s
text; exhaustively over the 256 single bytes and the 65536 byte pairs, and on random text and random bytes.
"""

from __future__ import annotations

import json
import os
import random
import stat

import pytest

from titan_dmuon.components.checkpoint.hf_io import export_hf
from titan_dmuon.config import ConfigError
from titan_dmuon.config.job_config import Checkpoint
from titan_dmuon.data.tokenizer import ByteTokenizer, build_tokenizer
from titan_dmuon.models.llama3 import SPEC, build_model

tokenizers = pytest.importorskip("tokenizers")

# Code point ranges random text draws from: every UTF-8 length, controls and the whitespace HF pre-tokenizers
# treat specially, combining marks, the byte-level alphabet's own characters (U+0100..U+0143), emoji.
_RANGES = [
    (0x00, 0x1F),
    (0x20, 0x7E),
    (0x7F, 0xFF),
    (0x100, 0x17F),
    (0x300, 0x36F),
    (0x400, 0x4FF),
    (0x2000, 0x206F),
    (0x3000, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xE000, 0xF8FF),
    (0xFFF0, 0xFFFF),
    (0x1F300, 0x1FAFF),
    (0x10000, 0x10FFFF),
]
_WORDS = [" ", "  ", "\n", "\r\n", "\t", "\u00a0", "\u2028", "'s", "don't", "<|begin_of_text|>", "<|end_of_text|>"]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(0, 24)):
            if rng.random() < 0.15:
                parts.append(rng.choice(_WORDS))
                continue
            lo, hi = rng.choice(_RANGES)
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:  # surrogates are not text (neither tokenizer takes them)
                cp = 0xFFFD
            parts.append(chr(cp))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_tokenizer")
    written = ByteTokenizer().save_hf(folder)
    assert sorted(p.name for p in written) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    return folder


def test_byte_tokenizer_hf_form_with_tokenizers(byte_folder):
    ours = ByteTokenizer()
    tok = tokenizers.Tokenizer.from_file(str(byte_folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == ours.vocab_size
    assert tok.token_to_id("<|begin_of_text|>") == ours.bos_id and tok.token_to_id("<|end_of_text|>") == ours.eos_id
    # every single byte: the one-character texts U+0000..U+00FF (1 and 2 UTF-8 bytes), and decoding each id alone
    singles = [chr(b) for b in range(256)]
    assert [e.ids for e in tok.encode_batch(singles)] == [ours.encode(t, bos=True, eos=False) for t in singles]
    assert tok.decode_batch([[b] for b in range(256)]) == [bytes([b]).decode("utf-8", "replace") for b in range(256)]
    # every byte pair (lone continuation bytes, truncated sequences, overlongs, surrogates' encodings, ...)
    pairs = [[a, b] for a in range(256) for b in range(256)]
    assert tok.decode_batch(pairs) == [ours.decode(p) for p in pairs]
    # random text: ids with BOS first (the post-processor) and no EOS; decoded back (skip_special_tokens)
    texts = [t for t in _random_texts(3000) if "<|" not in t]
    want = [ours.encode(t, bos=True, eos=False) for t in texts]
    got = [e.ids for e in tok.encode_batch(texts)]
    assert got == want
    assert tok.decode_batch(got) == texts == [ours.decode(ids) for ids in want]
    assert any(max(ids[1:], default=0) >= 0xF0 for ids in want)  # 4-byte sequences were drawn
    # random bytes, with BOS/EOS anywhere: the decoded text (U+FFFD for invalid UTF-8) is ours
    rng = random.Random(1)
    ids = [[rng.choice([*range(256), 256, 257]) for _ in range(rng.randrange(1, 16))] for _ in range(3000)]
    assert tok.decode_batch(ids) == [ours.decode(i) for i in ids]
    # a text that spells a special token: its bytes, as ours (plain `tokenizers` needs encode_special_tokens)
    tok.encode_special_tokens = True
    texts = [t for t in _random_texts(3000) if "<|" in t]
    assert len(texts) > 100
    assert [e.ids for e in tok.encode_batch(texts)] == [ours.encode(t, bos=True, eos=False) for t in texts]


def test_byte_tokenizer_hf_form_with_auto_tokenizer(byte_folder):
    transformers = pytest.importorskip("transformers")
    ours = ByteTokenizer()
    tok = transformers.AutoTokenizer.from_pretrained(str(byte_folder))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    assert len(tok) == ours.vocab_size
    texts = _random_texts(2000, seed=2) + [chr(b) for b in range(256)]
    texts += ["hello world", "  two  spaces \n\nnew lines\t", "héllo wörld ✓ 😀👩‍👩‍👧", "x<|end_of_text|>y"]
    got = tok(texts)["input_ids"]
    assert got == [ours.encode(t, bos=True, eos=False) for t in texts]  # special-token spellings included
    assert tok.batch_decode(got, skip_special_tokens=True) == texts
    rng = random.Random(3)
    ids = [[rng.choice([*range(256), 256, 257]) for _ in range(rng.randrange(1, 16))] for _ in range(2000)]
    assert tok.batch_decode(ids, skip_special_tokens=True) == [ours.decode(i) for i in ids]
    # padding a batch pads with EOS (right side), the attention mask marks it
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0] == [256, 97, 98, ours.eos_id, ours.eos_id]
    assert batch["attention_mask"][0] == [1, 1, 1, 0, 0]


def _word_level_folder(folder):
    """A tiny HF tokenizer folder (word level, BOS/EOS/PAD named by its config) with other files beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tok.json"))  # not named tokenizer.json: the copy is
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "config.json").write_text("{}")  # a model's, not the tokenizer's
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "notes.txt").write_text("not a tokenizer file")
    os.chmod(folder / "tok.json", 0o400)  # read-only at the source (a cache): the copy is a new file
    return folder / "tok.json"


def test_hf_tokenizer_save_hf_copies_the_tokenizer_files_only(tmp_path):
    tok = build_tokenizer(str(_word_level_folder(tmp_path / "src")))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    out = tmp_path / "out"
    written = tok.save_hf(out)
    names = ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in written) == sorted(os.listdir(out)) == names
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tok.json").read_bytes()
    assert stat.S_IMODE(os.stat(out / "tokenizer.json").st_mode) & 0o200  # writable: not the source's mode
    # without a pad token in its config, PAD is EOS
    config = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    assert build_tokenizer(str(tmp_path / "src" / "tok.json")).pad_id == 2


def test_export_with_an_hf_tokenizer_writes_its_own_three_special_ids(tmp_path):
    """BOS 1, EOS 2 and PAD 3, all different (the byte tokenizer's and a train_tokenizer.py BPE's PAD is their EOS,
    so there a PAD written as the EOS, or EOS and PAD swapped, passes): config.json, generation_config.json and
    transformers' loaders of the export give the ids the tokenizer folder's own vocabulary and tokenizer_config.json
    name. The model's vocabulary (8) is padded past the tokenizer's 6 ids: config.json says the model's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    tok = build_tokenizer(str(_word_level_folder(tmp_path / "src")))
    model = build_model("tinymodel", vocab_size=8, device="cpu", max_seq_len=16)
    export_hf(model.state_dict(), tmp_path / "hf", SPEC.state_dict_adapter(model), tokenizer=tok)
    want = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # <s>, </s>, <pad> in _word_level_folder
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in want} == want and config["vocab_size"] == 8
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == want
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 3)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 3)
    assert hf_tok.convert_ids_to_tokens([1, 2, 3]) == ["<s>", "</s>", "<pad>"]


def _modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_export_hf_writes_tokenizer_ids_and_plain_modes(tmp_path, umask, mode):
    pytest.importorskip("safetensors")
    tokenizer = ByteTokenizer()
    model = build_model("tinymodel", vocab_size=tokenizer.vocab_size, device="cpu", max_seq_len=32)
    adapter = SPEC.state_dict_adapter(model)
    before = os.umask(umask)
    try:
        export_hf(model.state_dict(), tmp_path / "one", adapter, tokenizer=tokenizer)
        files = export_hf(
            model.state_dict(), tmp_path / "sharded", adapter, max_shard_bytes=50_000, tokenizer=tokenizer
        )
    finally:
        os.umask(before)
    assert len(files) > 1
    for folder in (tmp_path / "one", tmp_path / "sharded"):
        modes = _modes(folder)
        assert set(modes.values()) == {mode}, modes
        assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"} <= set(
            modes
        )
        config = json.loads((folder / "config.json").read_text())
        generation = json.loads((folder / "generation_config.json").read_text())
        ids = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257}
        assert {k: config[k] for k in ids} == ids and generation == ids
    # without a tokenizer: the weights and config.json alone, as before
    export_hf(model.state_dict(), tmp_path / "bare", adapter)
    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "model.safetensors"]
    # a tokenizer with more ids than the model's vocabulary is not the model's: nothing is written
    small = build_model("tinymodel", vocab_size=97, device="cpu", max_seq_len=32)
    with pytest.raises(ValueError, match="258 ids but the model's vocabulary is 97"):
        export_hf(small.state_dict(), tmp_path / "small", SPEC.state_dict_adapter(small), tokenizer=tokenizer)
    assert os.listdir(tmp_path / "small") == []


def test_last_save_in_hf_needs_checkpoints():
    Checkpoint(enable=True, last_save_in_hf=True).validate()
    with pytest.raises(ConfigError, match="last_save_in_hf .* needs checkpoint.enable"):
        Checkpoint(last_save_in_hf=True).validate()


def test_generation_config_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    tokenizer = ByteTokenizer()
    model = build_model("tinymodel", vocab_size=tokenizer.vocab_size, device="cpu", max_seq_len=32)
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model), tokenizer=tokenizer)
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (256, 257, 257)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (256, 257, 257)
