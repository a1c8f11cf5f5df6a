"""Token shards: scripts/prepare_data.py writes them (in order, split, sharded, the same with any number of
workers), training reads them by memory map (the checks, the layout-independent order, exact resume)."""

from __future__ import annotations

import filecmp
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
    ShardWriter,
    TokenSource,
    build_dataloader,
    build_source,
    in_val_split,
    token_dtype,
    write_manifest,
)
from titan_dmuon.data.shards import check_vocab_fits

REPO = str(Path(__file__).resolve().parents[3])
prepare_data = load_script("prepare_data")  # the pool pickles its workers by module name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 short JSONL documents, and their texts in file order."""
    rng = np.random.default_rng(1)
    folder = tmp_path_factory.mktemp("raw")
    words = ["one", "two", "three", "four", "fünf", "six"]
    docs = [f"d{i} " + " ".join(rng.choice(words, int(rng.integers(1, 30)))) for i in range(300)]
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return folder, docs


def _prepare(src, out, **kw):
    args = {"dataset": "jsonl", "dataset_path": str(src), "output": str(out), "progress": False, **kw}
    return prepare_data.prepare(**args)


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    _prepare(corpus[0], out, shard_tokens=3000, val_fraction=0.1)
    return out


def test_prepare_writes_every_document_in_order(corpus, shards) -> None:
    _, docs = corpus
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["fingerprint"] == "byte"
    assert manifest["documents"] == len(docs) and len(manifest["splits"]["train"]["shards"]) > 2
    tok = ByteTokenizer()
    for split in ("train", "val"):
        src = TokenSource(str(shards), (split,))
        want = [tok.encode_array(t) for t in docs if in_val_split(t, 0.1) == (split == "val")]
        got = [src.documents(u)[0] for u in range(len(src))]
        assert len(got) == len(want) > 10 and manifest["splits"][split]["documents"] == len(want)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))  # no document spans shards
    for shard in manifest["splits"]["train"]["shards"][:-1]:
        assert shard["tokens"] <= 3000


def test_prepare_output_does_not_depend_on_workers(corpus, shards, tmp_path) -> None:
    _prepare(corpus[0], tmp_path, shard_tokens=3000, val_fraction=0.1, workers=2)
    names = sorted(os.listdir(shards))
    assert names == sorted(os.listdir(tmp_path))
    _, mismatch, errors = filecmp.cmpfiles(shards, tmp_path, names, shallow=False)
    assert mismatch == [] and errors == []


def test_prepare_refuses_bad_input_and_existing_output(corpus, shards, tmp_path, capsys) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    argv = ["--dataset", "jsonl", "--dataset-path", str(tmp_path / "bad.jsonl"), "--no-progress"]
    assert prepare_data.main([*argv, "--output", str(tmp_path / "out"), "--workers", "2"]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert prepare_data.main([*argv, "--output", str(shards)]) == 2
    assert "already holds prepared data" in capsys.readouterr().err
    with pytest.raises(DataError, match="holds ids below 65536"):
        check_vocab_fits(128256, "uint16", "--dtype uint16")
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def uint8_tokens(folder) -> None:
    """A consistent prepared folder whose dtype (uint8) cannot hold the byte tokenizer's BOS/EOS (256, 257)."""
    writer = ShardWriter(str(folder), "train", np.dtype(np.uint8), 1 << 20)
    writer.add(np.arange(10, dtype=np.int64), np.array([4, 6]))
    tokenizer = {"spec": "byte", "fingerprint": "byte", "vocab_size": 258, "bos_id": 256, "eos_id": 257}
    write_manifest(str(folder), {"dtype": "uint8", "tokenizer": tokenizer, "splits": {"train": writer.close()}})


def test_token_source_checks(shards, tmp_path) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    src = build_source("tokens", str(shards))
    assert len(src) == manifest["splits"]["train"]["documents"]
    assert len(build_source("tokens", str(shards), split="val", val_fraction=1.0)) == manifest["documents"]
    with pytest.raises(DataError, match="made with tokenizer 'byte'"):
        src.check_tokenizer(type("Other", (), {"fingerprint": "sha256:0123", "vocab_size": 300})())
    uint8_tokens(tmp_path)
    with pytest.raises(DataError, match="token dtype uint8 holds ids below 256"):
        build_source("tokens", str(tmp_path)).check_tokenizer(ByteTokenizer())
    with open(tmp_path / "train-00000.bin", "ab") as f:
        f.write(b"x")
    with pytest.raises(DataError, match=r"train-00000\.bin has 11 bytes, manifest\.json says 10"):
        build_source("tokens", str(tmp_path))
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(DataError, match="no manifest.json"):
        build_source("tokens", str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        build_source("tokens", str(tmp_path / "nowhere"))


def test_no_val_split_is_reported(corpus, tmp_path) -> None:
    _prepare(corpus[0], tmp_path, val_fraction=0.0)
    with pytest.raises(DataError, match="the val split has no documents"):
        build_source("tokens", str(tmp_path), split="val")


def _hash_puts(n: int, held_out: bool, fraction: float = 0.02) -> list[str]:
    """``n`` distinct documents that the hash rule holds out (or keeps), all of them."""
    docs = [t for t in (f"text {i}" for i in range(10**6)) if in_val_split(t, fraction) == held_out][:n]
    assert len(docs) == n
    return docs


def _prepared(folder: Path, docs: list[str], fraction: float = 0.02) -> Path:
    (folder / "raw").mkdir()
    (folder / "raw" / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    _prepare(folder / "raw", folder / "tokens", val_fraction=fraction)
    return folder / "tokens"


def _token_docs(src: TokenSource) -> list[bytes]:
    return [bytes(src.documents(u)[0][1:-1].tolist()) for u in range(len(src))]  # without BOS and EOS


def test_a_small_prepared_corpus_holds_out_one_document(tmp_path) -> None:
    # 49 documents at 2%: prepare_data.py's hash rule held out none, so the last train document is read as the
    # validation split (from the manifest alone: no second tokenization), and training reads the other 48
    docs = _hash_puts(49, held_out=False)
    out = _prepared(tmp_path, docs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 49 and manifest["splits"]["val"]["documents"] == 0
    train, val = build_source("tokens", str(out)), build_source("tokens", str(out), split="val")
    assert _token_docs(train) == [t.encode() for t in docs[:48]] and _token_docs(val) == [docs[48].encode()]
    assert train.tokens + val.tokens == manifest["tokens"] and "held out for the val split" in train.description
    assert len(build_source("tokens", str(out), split="val", val_fraction=1.0)) == 49  # a whole dataset: all
    loader = build_dataloader(
        dataset="tokens",
        dataset_path=str(out),
        tokenizer=ByteTokenizer(),
        dp_rank=0,
        dp_world_size=1,
        local_batch_size=1,
        seq_len=8,
        split="val",
    )
    assert next(iter(loader))[0][0].tolist() == [ByteTokenizer.bos_id, *docs[48].encode()][:8]


@pytest.mark.parametrize("held_out", [False, True], ids=["kept-by-hash", "held-out-by-hash"])
def test_one_prepared_document_stays_in_train(tmp_path, held_out: bool) -> None:
    # never all of them: a lone document is trained on, even when prepare_data.py wrote it to the val split
    (doc,) = _hash_puts(1, held_out=held_out)
    out = _prepared(tmp_path, [doc])
    assert _token_docs(build_source("tokens", str(out))) == [doc.encode()]
    with pytest.raises(DataError, match="the val split has no documents: one document cannot be split"):
        build_source("tokens", str(out), split="val")


def _batches(shards, rank: int, world: int, local: int, n: int, **kw):
    loader = build_dataloader(
        dataset="tokens",
        dataset_path=str(shards),
        tokenizer=ByteTokenizer(),
        dp_rank=rank,
        dp_world_size=world,
        local_batch_size=local,
        seq_len=32,
        seed=2,
        **kw,
    )
    it = iter(loader)
    return loader, it, [next(it) for _ in range(n)]


def test_tokens_global_batches_do_not_depend_on_the_dp_layout(shards) -> None:
    def hashes(world: int) -> list[str]:
        per_rank = [_batches(shards, r, world, 32 // world, 20)[2] for r in range(world)]
        out = []
        for step in range(20):
            rows = [None] * 32
            for r in range(world):
                for i, x in enumerate(per_rank[r][step][0]):
                    rows[r + world * i] = x
            out.append(hashlib.sha256(torch.stack(rows).numpy().tobytes()).hexdigest())
        return out

    reference = hashes(1)
    assert hashes(2) == reference and hashes(4) == reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tokens_loader_resume_is_exact(shards, num_workers: int) -> None:
    *_, uninterrupted = _batches(shards, 1, 2, 4, 30, num_workers=num_workers)
    loader, _, first = _batches(shards, 1, 2, 4, 18, num_workers=num_workers)
    state = loader.state_dict()
    resumed, _, _ = _batches(shards, 1, 2, 4, 0, num_workers=num_workers)
    resumed.load_state_dict(state)
    it = iter(resumed)
    rest = [next(it) for _ in range(12)]
    for (x, y), (u, v) in zip(first + rest, uninterrupted, strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)


def test_prepare_reads_a_hugging_face_dataset(corpus, tmp_path) -> None:
    """--dataset hf: a `save_to_disk` folder (`datasets` is optional at run time, a dev dependency for this test)."""
    import datasets

    _, docs = corpus
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(tmp_path / "saved"))
    manifest = _prepare(tmp_path / "saved", tmp_path / "out", dataset="hf", dataset_field="content", workers=2)
    assert manifest["documents"] == len(docs)
    src = TokenSource(str(tmp_path / "out"), ("train", "val"))
    assert sorted(ByteTokenizer().decode(src.documents(u)[0]) for u in range(len(src))) == sorted(docs)
