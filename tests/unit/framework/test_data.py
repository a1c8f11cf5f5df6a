"""Data pipeline: tokenizers, raw sources (byte ranges, paragraphs, parquet), the split, the permutation, row
packing, a global batch order independent of the DP layout, workers, exact loader resume, up-front checks.
(Token shards and prepare_data.py: test_data_shards.py.)"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._scripts import load_script
from titan_dmuon.data import (
    ByteTokenizer,
    DataError,
    FileSource,
    GlobalOrder,
    Permutation,
    RecordSource,
    RowReader,
    build_dataloader,
    build_source,
    build_tokenizer,
    checked_source,
    in_val_split,
    stdlib_source,
    take_census,
)
from titan_dmuon.data.sources import text_crc

REPO = str(Path(__file__).resolve().parents[3])
WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "theta"]


def _doc(rng, i: int) -> str:
    return f"doc{i} " + " ".join(rng.choice(WORDS, int(rng.integers(1, 40))))


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory):
    """400 short documents in two JSONL files (with blank lines), and their texts in file order."""
    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("jsonl")
    docs = [_doc(rng, i) for i in range(400)]
    for name, part in (("a.jsonl", docs[:250]), ("b.jsonl", docs[250:])):
        lines = [json.dumps({"text": t, "id": 0}) + ("\n\n" if k % 17 == 0 else "\n") for k, t in enumerate(part)]
        (folder / name).write_text("".join(lines), encoding="utf-8")
    return folder, docs


def _loader(path, rank: int = 0, world: int = 1, local: int = 4, **kw):
    args = {"dataset": "jsonl", "dataset_path": str(path), "tokenizer": ByteTokenizer(), "seq_len": 16, "seed": 5, **kw}
    return build_dataloader(**args, dp_rank=rank, dp_world_size=world, local_batch_size=local)


def _take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)
    )


# ------------------------------------------------------------------------------------------ tokenizers
def test_byte_tokenizer_round_trip() -> None:
    tok = build_tokenizer("byte")
    text = "héllo\nwörld 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257 and tok.vocab_size == 258
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=False, eos=False) == list(text.encode("utf-8"))


def _train_tokenizer(tmp_path, jsonl_folder) -> str:
    module = load_script("train_tokenizer")
    return module.train_tokenizer(
        dataset="jsonl", dataset_path=str(jsonl_folder), vocab_size=300, max_docs=200, output=str(tmp_path) + os.sep
    )


def test_hf_tokenizer_bos_eos_from_its_config(tmp_path, jsonl_corpus) -> None:
    path = _train_tokenizer(tmp_path, jsonl_corpus[0])
    tok = build_tokenizer(os.path.dirname(path))
    vocab = tok._tok.get_vocab()
    assert (tok.bos_id, tok.eos_id) == (vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"])
    text = "alpha beta épsilon\nzeta"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) < len(text.encode()) + 2
    assert tok.decode(ids) == text
    # The config decides, not a guess: swap the roles and the ids follow; no BOS is allowed, no EOS is not.
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": None, "eos_token": {"content": "<|begin_of_text|>"}}))
    swapped = build_tokenizer(path)
    assert swapped.bos_id is None and swapped.eos_id == vocab["<|begin_of_text|>"]
    assert swapped.encode("a")[0] != swapped.eos_id and swapped.fingerprint != tok.fingerprint
    config.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(DataError, match="names '<s>'"):
        build_tokenizer(path)
    config.unlink()
    with pytest.raises(DataError, match="no tokenizer_config.json"):
        build_tokenizer(path)


def test_tokenizer_paths_that_are_not_tokenizers(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        build_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="no tokenizer.json in this folder"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("hello world\n")
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(tmp_path))


# --------------------------------------------------------------------------------------------- sources
@pytest.mark.parametrize("chunk", [4096, 257, 64])
def test_jsonl_byte_ranges_hold_every_line_once(jsonl_corpus, chunk: int) -> None:
    folder, docs = jsonl_corpus
    src = RecordSource(sorted(str(p) for p in folder.iterdir()), "jsonl", "text", chunk_bytes=chunk)
    assert [t for u in range(len(src)) for t in src.texts(u)] == docs


@pytest.mark.parametrize("chunk", [1 << 20, 37, 5])
def test_text_paragraphs_hold_every_paragraph_once(tmp_path, chunk: int) -> None:
    text = "first para\nline two\n\n  \n\nsecond\n\n\nthird  para\r\nmore\n  \n" + "x" * 50 + "\nend"
    (tmp_path / "one.txt").write_text(text)
    src = RecordSource([str(tmp_path / "one.txt")], "paragraphs", chunk_bytes=chunk)
    got = [t for u in range(len(src)) for t in src.texts(u)]
    assert got == ["first para\nline two", "second", "third  para\r\nmore", "x" * 50 + "\nend"]
    # text_documents="file": one document per file
    per_file = build_source("text", str(tmp_path), text_documents="file")
    assert isinstance(per_file, FileSource) and per_file.texts(0) == [text]


def test_parquet_source(tmp_path) -> None:
    import pyarrow as pa  # a dev dependency: missing, this test fails rather than skips
    import pyarrow.parquet as pq

    table = pa.table({"content": [f"row {i}" if i != 3 else None for i in range(10)], "n": list(range(10))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)
    src = build_source("parquet", str(tmp_path), "content")
    assert len(src) == 3 and src.counted_documents() == 10
    assert src.texts(0) == ["row 0", "row 1", "row 2"] and src.texts(2) == ["row 8", "row 9"]
    with pytest.raises(DataError, match="no column 'text'"):
        build_source("parquet", str(tmp_path), "text")


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch) -> None:
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DataError, match=r'pip install -e "\.\[parquet\]"'):
        build_source("parquet", str(tmp_path))


def test_stdlib_source_offline() -> None:
    src = stdlib_source()
    assert isinstance(src, FileSource) and len(src) > 100
    names = [os.path.relpath(f, os.path.dirname(os.__file__)).replace(os.sep, "/") for f in src.files]
    assert "json/decoder.py" in names
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for n in names for part in n.split("/"))
    assert "def " in src.texts(names.index("json/decoder.py"))[0]


def test_split_by_text_hash(jsonl_corpus) -> None:
    folder, docs = jsonl_corpus
    train = build_source("jsonl", str(folder), split="train", val_fraction=0.1)
    val = build_source("jsonl", str(folder), split="val", val_fraction=0.1)
    got_train = [t for u in range(len(train)) for t in train.documents(u)]
    got_val = [t for u in range(len(val)) for t in val.documents(u)]
    assert got_val == [t for t in docs if in_val_split(t, 0.1)] and 20 < len(got_val) < 60
    assert sorted(got_train + got_val) == sorted(docs)
    everything = build_source("jsonl", str(folder), split="val", val_fraction=1.0)
    assert sum(len(everything.documents(u)) for u in range(len(everything))) == len(docs)


def _docs_the_hash_rule_puts(n: int, held_out: bool, fraction: float = 0.02, tag: str = "doc") -> list[str]:
    """``n`` distinct documents that the hash rule alone (``in_val_split``) holds out (or keeps), all of them."""
    found = (f"{tag} {i} " + WORDS[i % len(WORDS)] for i in range(10**6))
    docs = [t for t in found if in_val_split(t, fraction) == held_out][:n]
    assert len(docs) == n
    return docs


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return path


def _split(path: Path, fraction: float, dataset: str = "jsonl") -> dict[str, list[str]]:
    """Every document of each split of a checked source (as the train and validation loaders read them)."""
    got = {}
    for split in ("train", "val"):
        build = lambda s=split: build_source(dataset, str(path), split=s, val_fraction=fraction)  # noqa: E731
        src = checked_source(build, None, split)
        got[split] = [t for u in range(len(src)) for t in src.documents(u)]
    return got


def test_a_small_corpus_holds_out_one_document(tmp_path) -> None:
    # 49 documents at the default 2% (0.98 expected): here the hash rule holds out none (37% of such corpora), and
    # validation used to fail with an empty split. Now the document with the lowest CRC32 is held out.
    docs = _docs_the_hash_rule_puts(49, held_out=False)
    path = _write_jsonl(tmp_path / "c.jsonl", docs)
    got = _split(path, 0.02)
    lowest = min(docs, key=text_crc)
    assert got["val"] == [lowest]
    assert sorted(got["train"]) == sorted(t for t in docs if t != lowest) and len(got["train"]) == 48
    assert _split(path, 0.02) == got  # deterministic (and a function of the texts only)
    # the same on every rank: each rank counts its share of the units, and the merged counts give the bound
    src = RecordSource([str(path)], "jsonl", chunk_bytes=256)
    assert len(src) > 3
    whole = take_census(src, 0.02)
    merged = take_census(src, 0.02, 0, 3).merge(take_census(src, 0.02, 1, 3)).merge(take_census(src, 0.02, 2, 3))
    assert merged == whole and whole.split_bound(0.02) == (text_crc(lowest) + 1, 1)
    # through the loader: the validation batches read the held-out document only (BOS text EOS, again and again)
    val = _loader(path, split="val", val_fraction=0.02, local=1)
    one = [ByteTokenizer.bos_id, *lowest.encode(), ByteTokenizer.eos_id]
    assert _take(val, 1)[0][0][0].tolist() == (one * 16)[:16]


def test_a_split_never_holds_out_every_document(tmp_path) -> None:
    # two documents that the hash rule at 50% would both hold out: the one with the highest CRC32 stays in train
    docs = _docs_the_hash_rule_puts(2, held_out=True, fraction=0.5)
    got = _split(_write_jsonl(tmp_path / "c.jsonl", docs), 0.5)
    highest = max(docs, key=text_crc)
    assert got == {"train": [highest], "val": [t for t in docs if t != highest]}


@pytest.mark.parametrize("held_out", [False, True], ids=["kept-by-hash", "held-out-by-hash"])
def test_one_document_stays_in_train(tmp_path, held_out: bool) -> None:
    # One document cannot be split: it is trained on (even when its hash would hold it out: never all of them),
    # and a validation loader on the held-out split says so up front, before the model is built.
    (doc,) = _docs_the_hash_rule_puts(1, held_out=held_out, tag="only")
    path = _write_jsonl(tmp_path / "one.jsonl", [doc])
    assert len(_take(_loader(path, val_fraction=0.02), 2)) == 2  # one document loops
    train = checked_source(lambda: build_source("jsonl", str(path), val_fraction=0.02), None, "train")
    assert train.documents(0) == [doc]
    with pytest.raises(DataError, match="the val split is empty: one document cannot be split") as e:
        _loader(path, split="val", val_fraction=0.02)
    assert "validation.dataset" in str(e.value)


def test_a_large_corpus_keeps_its_hash_split(jsonl_corpus) -> None:
    # 400 documents: the hash rule holds some out at 2% and at 10%, so the checked split is exactly that rule's
    folder, docs = jsonl_corpus
    for fraction in (0.02, 0.1):
        got = _split(folder, fraction)
        want = [t for t in docs if in_val_split(t, fraction)]
        assert got["val"] == want and 0 < len(want) < len(docs)
        assert got["train"] == [t for t in docs if not in_val_split(t, fraction)]
    src = checked_source(lambda: build_source("jsonl", str(folder), split="val", val_fraction=0.02), None, "val")
    assert src.val_threshold is None  # the hash rule's bound, untouched


def test_a_small_parquet_corpus_holds_out_one_document(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # parquet is otherwise checked from its metadata; a corpus this small is read, so the split is repaired too
    docs = _docs_the_hash_rule_puts(49, held_out=False)
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet", row_group_size=10)
    got = _split(tmp_path, 0.02, dataset="parquet")
    lowest = min(docs, key=text_crc)
    assert got["val"] == [lowest] and len(got["train"]) == 48


# ------------------------------------------------------------------------------------------ the order
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection(n: int) -> None:
    perm = [Permutation(n, (3, 0))(i) for i in range(n)]
    assert sorted(perm) == list(range(n))
    if n >= 64:
        assert perm != list(range(n)) and perm != [Permutation(n, (3, 1))(i) for i in range(n)]


def test_rows_pack_their_units_contiguously(jsonl_corpus) -> None:
    """Row j's windows are its units' documents (BOS text EOS) back to back, cut every seq_len tokens, each
    window one token longer (the next one's first token)."""
    folder, _ = jsonl_corpus
    src = build_source("jsonl", str(folder), min_units=16)
    order, tok, seq_len, B = GlobalOrder(len(src), 4, seed=1), ByteTokenizer(), 8, 4
    for row in (0, 3):
        reader = RowReader(src, tok, order, row, seq_len, (0, 0, 0))
        windows = [reader.window() for _ in range(60)]
        stream = np.concatenate([tok.encode_array(t) for k in range(20) for t in src.documents(order.unit(row, k))])
        for i, w in enumerate(windows):
            np.testing.assert_array_equal(w, stream[i * seq_len : i * seq_len + seq_len + 1])
    U = len(src)  # the first U positions (one epoch) visit every unit once
    assert sorted(order.unit(j, k) for k in range(-(-U // B)) for j in range(B) if j + k * B < U) == list(range(U))


def _global_batches(path, world: int, local: int, steps: int, accum: int = 1, **kw) -> list[str]:
    """Hash of each step's global batch, rows put back in global order (rank r holds rows r, r + world, ...)."""
    B = local * world * accum
    its = [iter(_loader(path, r, world, local, global_batch_size=B, **kw)) for r in range(world)]
    hashes = []
    for _ in range(steps):
        rows: list = [None] * B
        for r, it in enumerate(its):
            micro = [next(it) for _ in range(accum)]
            x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
            assert x.shape == y.shape == (local * accum, 16) and torch.equal(x[:, 1:], y[:, :-1])
            for i in range(local * accum):
                rows[r + world * i] = torch.cat([x[i], y[i, -1:]])
        hashes.append(hashlib.sha256(torch.stack(rows).numpy().tobytes()).hexdigest())
    return hashes


def test_global_batches_do_not_depend_on_the_dp_layout(jsonl_corpus) -> None:
    """4 ranks x 8, 2 x 16, 1 x 32 and 2 x 8 x 2 micro-batches: the same 32-row global batches, 20 steps."""
    folder, _ = jsonl_corpus
    reference = _global_batches(folder, 1, 32, 20)
    assert len(set(reference)) == 20
    assert _global_batches(folder, 2, 16, 20) == reference
    assert _global_batches(folder, 4, 8, 20) == reference
    assert _global_batches(folder, 2, 8, 20, accum=2) == reference
    assert _global_batches(folder, 1, 32, 20, seed=6) != reference


# ----------------------------------------------------------------------------------- loader and resume
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_workers_give_the_same_batches(jsonl_corpus) -> None:
    """Worker w of W packs rows w, w + W, ... of the rank's 8: the batches do not depend on W."""
    folder, _ = jsonl_corpus
    reference = _take(_loader(folder, 1, 2, local=8), 12)
    assert _same(_take(_loader(folder, 1, 2, local=8, num_workers=2), 12), reference)
    assert _same(_take(_loader(folder, 1, 2, local=8, num_workers=3), 12), reference)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_is_exact(jsonl_corpus, num_workers: int) -> None:
    """Stopped after 29 micro-batches (inside a step of 2 micro-batches, the rows already in their second
    epoch) and restored: the same batches as a loader that never stopped."""
    folder, _ = jsonl_corpus
    kw = dict(rank=1, world=2, local=3, global_batch_size=12, seq_len=256, num_workers=num_workers)
    uninterrupted = _take(_loader(folder, **kw), 45)

    loader = _loader(folder, **kw)
    it = iter(loader)
    first = [next(it) for _ in range(29)]
    state = loader.state_dict()
    del it
    if num_workers == 0:
        ds = loader.dataset
        positions = [j + k * 12 for j, (k, _, _) in zip(ds.rows, state["loader"]["dataset_state"]["rows"], strict=True)]
        assert max(positions) >= len(ds.source)  # past the first epoch
    resumed = _loader(folder, **kw)
    resumed.load_state_dict(state)
    assert state["served"] == 1 and _same(first + _take(resumed, 16), uninterrupted)


def test_validation_restarts_on_every_iter(jsonl_corpus) -> None:
    folder, _ = jsonl_corpus
    val = _loader(folder, split="val", val_fraction=0.1)
    first, again = _take(val, 5), _take(val, 5)
    assert _same(first, again)
    x = first[0][0][0]  # row 0's first window: BOS, then the first bytes of a held-out document
    assert int(x[0]) == ByteTokenizer.bos_id
    held_out = [t.encode() for t in jsonl_corpus[1] if in_val_split(t, 0.1)]
    assert bytes(x[1:].tolist()) in {t[:15] for t in held_out}


# ----------------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize(
    "content,match",
    [
        ('{"text": "a"}\n{"text": "b"}\n\n{"text": nope}\n', r"bad\.jsonl:4: not valid JSON"),
        ('{"text": "a"}\n{"body": "b"}\n', r"bad\.jsonl:2: no field 'text' \(the record has \['body'\]\)"),
        ("", r"bad\.jsonl: empty"),
        ("\n\n  \n", r"bad\.jsonl: no documents"),
    ],
    ids=["bad-json", "missing-field", "empty-file", "blank-file"],
)
def test_checks_name_the_file_and_line(tmp_path, content: str, match: str) -> None:
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        _loader(tmp_path / "bad.jsonl")


def test_a_bad_jsonl_line_names_its_line_and_column(tmp_path) -> None:
    # a raw control character (here a tab) inside a string on line 3: json's message names it with line 1 (of the
    # one-line document) and its column; the error keeps that whole, with the file's line and the column
    lines = ['{"text": "a"}', "", '{"text": "x\ty"}', '{"text": "d"}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        _loader(tmp_path / "bad.jsonl")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'bad.jsonl'}:3: not valid JSON at line 3, column 12: ")
    assert "Invalid control character at: line 1 column 12 (char 11)" in message
    assert 'near \'{"text": "x\\ty"}\'' in message and "fix or delete that line" in message
    # a line cut short: the column past its end, on that line (not "line 2 column 1" of the next)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n{"text": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON at line 2, column 10: Expecting value: line 1"):
        _loader(tmp_path / "bad.jsonl")
    # bytes that are not UTF-8: the byte where they start
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON at line 2, byte 11: not UTF-8"):
        _loader(tmp_path / "bad.jsonl")


def test_checks_paths_globs_and_splits(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        _loader(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="matches no files"):
        _loader(tmp_path / "*.jsonl")
    (tmp_path / "x.jsonl").write_text('{"text": "only one document"}\n')
    assert len(_take(_loader(tmp_path / "*.jsonl"), 2)) == 2  # a glob that matches; one document loops
    with pytest.raises(DataError, match="the val split is empty"):
        _loader(tmp_path / "x.jsonl", split="val")
    src = build_source("jsonl", str(tmp_path), split="train")
    assert checked_source(lambda: src, ByteTokenizer(), "train") is src
