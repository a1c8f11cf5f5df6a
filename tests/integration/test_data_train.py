"""train.py from prepare_data.py's token shards: one process with no DataLoader workers, and 2 ranks with 2
workers each (half the local batch), train and validate on the same global batches, so on the same losses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._scripts import load_script
from tests.train_runs import assert_loss_falls, assert_same_run, train


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    prepare_data = load_script("prepare_data")  # the one module object the tests share (tests/_scripts.py)

    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["red", "green", "blue", "light", "dark", "sky", "sea", "stone"]
    docs = [" ".join(rng.choice(words, int(rng.integers(5, 60)))) + "." for _ in range(2000)]
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    prepare_data.prepare(dataset="jsonl", dataset_path=str(folder), output=str(folder / "tokens"), progress=False)
    return folder / "tokens"


@pytest.mark.slow
def test_tokens_with_workers_on_2_ranks_match_one_process(shards, tmp_path) -> None:
    common = ["--training.dataset", "tokens", "--training.dataset_path", str(shards)]
    common += ["--validation.enable", "true", "--validation.freq", "10", "--validation.steps", "2"]
    one = train(1, tmp_path / "one", *common, "--training.local_batch_size", "8")
    two = train(2, tmp_path / "two", *common, "--training.local_batch_size", "4", "--training.num_workers", "2")
    assert_loss_falls(one)
    assert_same_run(two, one)
    assert sorted(two["loss/validation"]) == [10, 20]  # the same held-out batches (8 rows) too
    assert two["loss/validation"] == pytest.approx(one["loss/validation"], rel=1e-4)
