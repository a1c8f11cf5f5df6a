"""Data pipeline: tokenizers, sources, split, packing, DP sharding, exact loader resume."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from titan_dmuon.data import (
    ByteTokenizer,
    PackedDataset,
    build_dataloader,
    build_source,
    build_tokenizer,
    split_mask,
    stdlib_source,
)
from titan_dmuon.data.datasets import FileSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def text_dir(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "\n"]
    for i in range(40):
        n = int(rng.integers(1, 60))
        (tmp_path / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, n)), encoding="utf-8")
    return tmp_path


def _stream(ds: PackedDataset) -> np.ndarray:
    """The split's whole token stream for epoch 0, built independently of the packing code."""
    order = ds._order(0)
    return np.concatenate([ByteTokenizer().encode_array(ds.source.text(int(i))) for i in order])


def _windows(ds: PackedDataset, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_byte_tokenizer_round_trip() -> None:
    tok = build_tokenizer("byte")
    text = "héllo\nwörld 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257 and tok.vocab_size == 258
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=False, eos=False) == list(text.encode("utf-8"))


def test_packing_is_contiguous_and_shifted(text_dir) -> None:
    seq_len = 16
    ds = PackedDataset(build_source("text", str(text_dir)), ByteTokenizer(), seq_len, split="train", shuffle=True)
    stream = _stream(ds)
    n = (len(stream) - 1) // seq_len  # full windows in one epoch
    for k, (x, y) in enumerate(_windows(ds, n)):
        assert x.dtype == torch.int64 and x.shape == y.shape == (seq_len,)
        np.testing.assert_array_equal(x.numpy(), stream[k * seq_len : k * seq_len + seq_len])
        np.testing.assert_array_equal(y.numpy(), stream[k * seq_len + 1 : k * seq_len + seq_len + 1])


@pytest.mark.parametrize("world", [2, 4])
def test_dp_sharding_disjoint_and_covering(text_dir, world: int) -> None:
    seq_len, rounds = 8, 30
    src = build_source("text", str(text_dir))
    single = PackedDataset(src, ByteTokenizer(), seq_len, split="train")
    reference = [x for x, _ in _windows(single, world * rounds)]
    per_rank = [
        [x for x, _ in _windows(PackedDataset(src, ByteTokenizer(), seq_len, r, world), rounds)] for r in range(world)
    ]
    # Window g of the global stream goes to rank g % world: disjoint, and together they cover the stream.
    for g, ref in enumerate(reference):
        assert torch.equal(per_rank[g % world][g // world], ref)


def test_split_is_deterministic_disjoint_and_nonempty(text_dir) -> None:
    src = build_source("text", str(text_dir))
    train, val = split_mask(src, "train"), split_mask(src, "val")
    assert train.any() and val.any() and not (train & val).any() and (train | val).all()
    np.testing.assert_array_equal(val, split_mask(build_source("text", str(text_dir)), "val"))


def test_val_is_finite_restartable_and_equal_across_ranks(text_dir) -> None:
    src = build_source("text", str(text_dir))
    counts = []
    for r in range(3):
        ds = PackedDataset(src, ByteTokenizer(), 4, r, 3, split="val", val_fraction=0.3)
        first, second = list(ds), list(ds)
        assert len(first) == len(second) > 0
        assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
        counts.append(len(first))
    assert len(set(counts)) == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_round_trip(text_dir, num_workers: int) -> None:
    kw = dict(
        dataset="text",
        dataset_path=str(text_dir),
        dataset_field="",
        tokenizer=ByteTokenizer(),
        dp_rank=1,
        dp_world_size=2,
        local_batch_size=3,
        seq_len=32,
        seed=7,
        num_workers=num_workers,
    )
    loader = build_dataloader(**kw)
    it = iter(loader)
    for _ in range(40):  # past one epoch of this small corpus, so the epoch counter is exercised too
        next(it)
    state = loader.state_dict()
    if num_workers == 0:
        assert state["dataset_state"]["epoch"] >= 1
    expected = [next(it) for _ in range(3)]

    resumed = build_dataloader(**kw)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    for x_exp, y_exp in expected:
        x, y = next(it2)
        assert x.shape == (3, 32) and x.dtype == torch.int64
        assert torch.equal(x, x_exp) and torch.equal(y, y_exp)


def test_epochs_reshuffle(text_dir) -> None:
    ds = PackedDataset(build_source("text", str(text_dir)), ByteTokenizer(), 8, seed=3)
    assert not np.array_equal(ds._order(0), ds._order(1))
    assert sorted(ds._order(0)) == sorted(ds._order(1))


def test_jsonl_source(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i}", "id": i}) for i in range(5)) + "\n\n")
    src = build_source("jsonl", str(path), "body")
    assert len(src) == 5 and src.text(3) == "document 3" and src.key(3) == "data.jsonl:3"
    with pytest.raises(KeyError, match="no field 'text'"):
        build_source("jsonl", str(path), "text").text(0)


def test_parquet_source(tmp_path) -> None:
    import pyarrow as pa  # a dev dependency: missing, this test fails rather than skips
    import pyarrow.parquet as pq

    table = pa.table({"content": [f"row {i}" for i in range(10)], "n": list(range(10))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)
    src = build_source("parquet", str(tmp_path), "content")
    assert len(src) == 10 and src.blocks == [(0, 4), (4, 8), (8, 10)]
    assert [src.text(i) for i in (9, 0, 5)] == ["row 9", "row 0", "row 5"]
    assert src.key(5) == "a.parquet:5"
    with pytest.raises(KeyError, match="no column 'text'"):
        build_source("parquet", str(tmp_path), "text")
    # shuffling keeps row groups together
    ds = PackedDataset(src, ByteTokenizer(), 4, shuffle=True, val_fraction=0.0)
    groups = [int(i) // 4 for i in ds._order(0)]
    assert groups == sorted(groups, key=groups.index)  # each group's rows are contiguous


def test_stdlib_source_offline() -> None:
    src = stdlib_source()
    assert isinstance(src, FileSource) and len(src) > 100
    keys = [src.key(i) for i in range(len(src))]
    assert keys == sorted(keys) and any(k == "json/decoder.py" for k in keys)
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for k in keys for part in k.split("/"))
    assert "def " in src.text(keys.index("json/decoder.py"))


def test_hf_tokenizer(tmp_path, text_dir) -> None:
    script = os.path.join(REPO, "scripts", "train_tokenizer.py")
    spec = importlib.util.spec_from_file_location("train_tokenizer", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.train_tokenizer(
        dataset="text", dataset_path=str(text_dir), vocab_size=300, max_docs=30, output=str(tmp_path / "tok") + os.sep
    )
    tok = build_tokenizer(os.path.dirname(path))
    assert tok.vocab_size <= 300 and {tok.bos_id, tok.eos_id} <= set(range(tok.vocab_size))
    text = "alpha beta épsilon\nzeta"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) < len(text.encode()) + 2
    assert tok.decode(ids) == text
    # The packed stream works with it too.
    ds = PackedDataset(build_source("text", str(text_dir)), tok, 8)
    x, y = next(iter(ds))
    assert int(x.max()) < tok.vocab_size and torch.equal(x[1:], y[:-1])
