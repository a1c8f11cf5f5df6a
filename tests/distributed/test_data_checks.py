"""The up-front data checks on 2 real gloo ranks: each rank reads half of a raw corpus, and both report the
same error, also when only one rank found it or only one rank could not open its path (no hang)."""

from __future__ import annotations

import json

import pytest

from tests._dist import run_distributed


def _build(rank: int, world: int, paths: list[str]) -> str:
    from titan_dmuon.data import ByteTokenizer, DataError, build_dataloader

    try:
        loader = build_dataloader(
            dataset="jsonl",
            dataset_path=paths[rank],
            tokenizer=ByteTokenizer(),
            dp_rank=rank,
            dp_world_size=world,
            local_batch_size=2,
            seq_len=16,
        )
    except DataError as e:
        return f"error: {e}"
    return f"ok: {tuple(next(iter(loader))[0].shape)}"


@pytest.mark.slow
def test_ranks_agree_on_data_errors(tmp_path) -> None:
    from titan_dmuon.data import build_source

    good = [json.dumps({"text": f"document {i} " + "word " * (i % 30)}) + "\n" for i in range(300)]
    (tmp_path / "good.jsonl").write_text("".join(good))
    ok, bad, missing = (str(tmp_path / name) for name in ("good.jsonl", "bad.jsonl", "missing.jsonl"))
    # The bad line goes into an odd unit: only rank 1 reads it during the check.
    chunk = build_source("jsonl", ok, min_units=4 * 4).chunk
    offsets = [sum(len(line) for line in good[:k]) for k in range(len(good))]
    k = next(k for k in range(len(good)) if (offsets[k] // chunk) % 2 == 1)
    (tmp_path / "bad.jsonl").write_text("".join(good[:k] + ['{"text": "cut off\n'] + good[k:]))
    assert build_source("jsonl", bad, min_units=4 * 4).chunk == chunk

    assert run_distributed(_build, 2, [ok, ok], timeout=120) == ["ok: (2, 16)"] * 2
    reports = run_distributed(_build, 2, [bad, bad], timeout=120)
    assert reports[0] == reports[1] and f"{bad}:{k + 1}: not valid JSON" in reports[0], reports
    reports = run_distributed(_build, 2, [ok, missing], timeout=120)  # rank 1's path is not there
    expected = f"error: {missing} does not exist; set the dataset path to a file, a folder or a glob"
    assert reports[0] == reports[1] == expected
