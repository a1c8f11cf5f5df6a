"""A launch's path checks (titan_dmuon/preflight.py): each missing path a config can name is one ConfigError naming
the field, found without importing torch, through train.py and through the launchers before torchrun starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.data.shards import FORMAT, MANIFEST
from titan_dmuon.preflight import check_paths

REPO = Path(__file__).resolve().parents[3]


def _cfg(**sections) -> JobConfig:
    cfg = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def _prepared(folder: Path) -> Path:
    """A folder that passes as prepare_data.py's output (its manifest is what the check reads)."""
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT}))
    return folder


@pytest.mark.parametrize(
    "sections, field, words",
    [
        ({"training": {"dataset": "tokens", "dataset_path": "{tmp}/none"}}, "training.dataset_path", "prepare_data"),
        ({"training": {"dataset": "jsonl", "dataset_path": "{tmp}/none.jsonl"}}, "training.dataset_path", "exist"),
        ({"training": {"dataset": "text", "dataset_path": "{tmp}/*.txt"}}, "training.dataset_path", "matches no"),
        ({"training": {"dataset": "jsonl", "dataset_path": "{tmp}/empty"}}, "training.dataset_path", "no .jsonl"),
        (
            {"validation": {"enable": True, "dataset": "text", "dataset_path": "{tmp}/val"}},
            "validation.dataset_path",
            "exist",
        ),
        ({"model": {"tokenizer": "{tmp}/tokenizer/llama3"}}, "model.tokenizer", "download_hf_assets.py"),
        ({"model": {"tokenizer": "{tmp}/tok.json"}}, "model.tokenizer", "no such file"),
        ({"checkpoint": {"initial_load_path": "{tmp}/step-10"}}, "checkpoint.initial_load_path", "not a folder"),
    ],
)
def test_each_missing_path_names_its_field(tmp_path, sections, field, words) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("a file of another kind")
    sections = {s: {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in kv.items()}
                for s, kv in sections.items()}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_paths(_cfg(**sections))
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and words in msg and str(tmp_path) in msg, msg


def test_present_paths_pass(tmp_path) -> None:
    """The same fields pointing at what exists: no error (the check is no stricter than the trainer)."""
    tokens = _prepared(tmp_path / "tokens")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "weights").mkdir()
    check_paths(JobConfig())  # the embedded default data and the byte tokenizer
    check_paths(_cfg(training={"dataset": "tokens", "dataset_path": str(tokens)}))
    check_paths(
        _cfg(
            training={"dataset": "text", "dataset_path": str(tmp_path / "corpus")},
            validation={"enable": True, "dataset": "text", "dataset_path": str(tmp_path / "corpus" / "*.txt")},
            model={"tokenizer": str(tmp_path / "tok.json")},
            checkpoint={"initial_load_path": str(tmp_path / "weights")},
        )
    )
    # validation without a dataset of its own reads the training data's held-out part: nothing more to check
    check_paths(_cfg(validation={"enable": True, "dataset": "", "dataset_path": str(tmp_path / "gone")}))


def test_a_dry_run_does_not_check_this_machines_paths(tmp_path) -> None:
    """A dry run plans another machine's run: its data need not be here."""
    check_paths(_cfg(job={"dry_run": True}, training={"dataset": "tokens", "dataset_path": str(tmp_path / "x")}))


def _run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def test_train_py_reports_a_bad_path_in_one_line_before_importing_torch(tmp_path) -> None:
    """As a user makes the mistake: one line on stderr, exit 2, and torch never imported (the start-up it saves)."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['train.py', '--config', 'train_configs/debug_model.toml', '--training.dataset', 'tokens',\n"
        f"            '--training.dataset_path', {str(tmp_path / 'missing')!r}]\n"
        "try:\n"
        "    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('torch imported:', 'torch' in sys.modules, 'exit', e.code)\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.stdout.strip() == "torch imported: False exit 2", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: training.dataset_path: "), proc.stderr
    assert str(tmp_path / "missing") in lines[0] and "prepare_data.py" in lines[0]


def test_run_train_sh_stops_before_torchrun(tmp_path) -> None:
    """run_train.sh checks the flags and paths before torchrun starts: a bad path is the same one line and exit 2,
    and nothing else is printed (torchrun and its ranks never started: they would log, then fail later)."""
    proc = _run(
        ["bash", "run_train.sh", "--training.dataset", "jsonl", "--training.dataset_path", str(tmp_path / "x.jsonl")],
        env={"NPROC": "2", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [f"config error: training.dataset_path: {tmp_path / 'x.jsonl'} does not exist; set the dataset "
                     "path to a file, a folder or a glob"], lines  # fmt: skip
