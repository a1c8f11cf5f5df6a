"""Bad data inputs through `python train.py`: exit 2 with one `config error:` paragraph that names the file (and
line) and the fix, no traceback, and before the model is built (so in seconds, not after minutes of setup)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests._dist import run_script
from titan_dmuon.data import ShardWriter, write_manifest

REPO = Path(__file__).resolve().parents[2]


def uint8_tokens(folder: Path) -> None:
    """A consistent prepared folder whose dtype (uint8) cannot hold the byte tokenizer's BOS/EOS (256, 257)."""
    writer = ShardWriter(str(folder), "train", np.dtype(np.uint8), 1 << 20)
    writer.add(np.arange(10, dtype=np.int64), np.array([4, 6]))
    tokenizer = {"spec": "byte", "fingerprint": "byte", "vocab_size": 258, "bos_id": 256, "eos_id": 257}
    write_manifest(str(folder), {"dtype": "uint8", "tokenizer": tokenizer, "splits": {"train": writer.close()}})


def _case(name: str, d: Path) -> tuple[list[str], list[str], dict[str, str]]:
    """(train.py arguments, texts the message must hold, extra environment) of one bad input under ``d``."""
    jsonl = ["--training.dataset", "jsonl", "--training.dataset_path"]
    if name == "missing-path":
        return [*jsonl, str(d / "nope.jsonl")], [str(d / "nope.jsonl"), "does not exist"], {}
    if name == "glob-matches-nothing":
        return [*jsonl, str(d / "*.jsonl")], [str(d / "*.jsonl"), "matches no files"], {}
    if name == "empty-file":
        (d / "empty.jsonl").write_text("")
        return [*jsonl, str(d / "empty.jsonl")], [str(d / "empty.jsonl"), "empty"], {}
    if name == "bad-jsonl-line":
        (d / "bad.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": two}\n{"text": "four"}\n')
        expected = [f"{d / 'bad.jsonl'}:4: not valid JSON at line 4, column 10", "Expecting value", "fix or delete"]
        return [*jsonl, str(d)], expected, {}
    if name == "missing-field":
        (d / "a.jsonl").write_text('{"content": "one"}\n')
        return [*jsonl, str(d / "a.jsonl")], [f"{d / 'a.jsonl'}:1: no field 'text'", "'content'"], {}
    if name == "not-a-tokenizer":
        (d / "tokenizer.json").write_text("this is not a tokenizer\n")
        return ["--model.tokenizer", str(d / "tokenizer.json")], ["model.tokenizer", "is not a Hugging Face"], {}
    if name == "parquet-without-pyarrow":
        (d / "shim" / "pyarrow").mkdir(parents=True)
        (d / "shim" / "pyarrow" / "__init__.py").write_text("raise ImportError('No module named pyarrow')\n")
        (d / "a.parquet").write_bytes(b"PAR1")
        args = ["--training.dataset", "parquet", "--training.dataset_path", str(d / "a.parquet")]
        return args, ["needs pyarrow", 'pip install -e ".[parquet]"'], {"PYTHONPATH": str(d / "shim")}
    if name == "vocab-exceeds-dtype":
        uint8_tokens(d)
        args = ["--training.dataset", "tokens", "--training.dataset_path", str(d)]
        return args, [str(d / "manifest.json"), "uint8 holds ids below 256", "258"], {}
    raise ValueError(name)


CASES = [
    "missing-path",
    "glob-matches-nothing",
    "empty-file",
    "bad-jsonl-line",
    "missing-field",
    "not-a-tokenizer",
    "parquet-without-pyarrow",
    "vocab-exceeds-dtype",
]


@pytest.mark.parametrize("name", CASES)
def test_bad_data_exits_2_before_the_model(tmp_path, name: str) -> None:
    args, expected, env = _case(name, tmp_path)
    argv = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "out"), *args]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    start = time.perf_counter()
    proc = run_script(1, "train.py", argv, cwd=str(REPO), env=environ, timeout=120)
    elapsed = time.perf_counter() - start
    tail = f"exit {proc.returncode} after {elapsed:.1f} s\n{proc.stderr[-4000:]}"
    assert proc.returncode == 2, tail
    assert "Traceback" not in proc.stderr and "Model llama3" not in proc.stderr, tail  # no model was built
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    for text in expected:
        assert text in message, tail
