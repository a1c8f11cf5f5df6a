"""scripts/download_hf_assets.py (tested against a local folder: no test reaches the Hub) and the start-up message
of a config whose tokenizer was never downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests._scripts import load_script
from titan_dmuon.data import DataError, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "download_hf_assets.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def fake_model_repo(folder: Path) -> Path:
    """A folder laid out like a Hub model repo: a real (tiny, word-level) tokenizer.json, its config, and files
    the script must leave behind."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|begin_of_text|>", "<|end_of_text|>", "[UNK]", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(config))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )


def test_local_folder_gives_a_loadable_tokenizer(tmp_path) -> None:
    source = fake_model_repo(tmp_path / "Llama-fake")
    target = tmp_path / "assets" / "tokenizer" / "llama3"
    proc = _run("--repo_id", str(source), "--assets", "tokenizer", "--local_dir", str(target))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(target)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    tok = build_tokenizer(str(target / "tokenizer.json"))
    assert tok.encode("hello world") == [0, 3, 4, 1] and tok.vocab_size == 5


def test_missing_local_folder_exits_2(tmp_path) -> None:
    missing = tmp_path / "no-such-repo"
    proc = _run("--repo_id", str(missing), "--local_dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert str(missing) in line and "no such folder" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_folder_without_tokenizer_json_exits_2(tmp_path) -> None:
    source = fake_model_repo(tmp_path / "repo")
    (source / "tokenizer.json").unlink()
    proc = _run("--repo_id", str(source), "--local_dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "has no tokenizer.json" in proc.stderr, proc.stderr


def _hub_error(name: str, status: int) -> Exception:
    """One of huggingface_hub's HTTP errors as the library builds them: a message and the (failed) response."""
    import huggingface_hub.utils as hf_utils

    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return getattr(hf_utils, name)(f"{status} Client Error (fake)", response=response)


@pytest.mark.parametrize(
    ("error", "token", "expected"),
    [
        (lambda: _hub_error("GatedRepoError", 401), None, ["meta-llama/Llama-3.1-8B is gated", "HF_TOKEN"]),
        (lambda: _hub_error("GatedRepoError", 403), "hf_x", ["has no access", "accept the license"]),
        (lambda: _hub_error("RepositoryNotFoundError", 401), None, ["no such repo", "HF_TOKEN"]),
        (lambda: ConnectionError("Name or service not known"), None, ["cannot reach", "--repo_id"]),
    ],
    ids=["gated-no-token", "gated-no-access", "no-such-repo", "no-network"],
)
def test_hub_failures_exit_2_with_the_fix(monkeypatch, capsys, error, token, expected) -> None:
    import huggingface_hub

    module = load_script("download_hf_assets")

    def fail(*args, **kwargs):
        raise error()

    monkeypatch.setattr(huggingface_hub, "list_repo_files", fail)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    argv = ["--repo_id", "meta-llama/Llama-3.1-8B", "--local_dir", "unused"]
    assert module.main(argv + (["--hf_token", token] if token else [])) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    for text in expected:
        assert text in line, line


def test_hub_download_takes_only_the_tokenizer_files(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    module = load_script("download_hf_assets")
    listed = ["config.json", "tokenizer.json", "tokenizer_config.json", "original/tokenizer.model", "x.safetensors"]
    fetched = []
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, token=None: listed)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda repo_id, name, local_dir, token: fetched.append(name) or name
    )
    assert module.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--local_dir", str(tmp_path)]) == 0
    assert fetched == ["tokenizer.json", "tokenizer_config.json"]


def test_missing_tokenizer_names_the_file_and_the_command(tmp_path) -> None:
    spec = str(tmp_path / "assets" / "tokenizer" / "llama3" / "tokenizer.json")
    with pytest.raises(DataError) as info:
        build_tokenizer(spec)
    message = str(info.value)
    assert f"tokenizer file {spec} is missing" in message
    assert "python scripts/download_hf_assets.py --repo_id" in message
    assert f"--local_dir {os.path.dirname(spec)}" in message
    (tmp_path / "assets" / "tokenizer" / "llama3").mkdir(parents=True)  # the folder alone: the same hint
    with pytest.raises(DataError, match="no tokenizer.json in this folder.*download_hf_assets.py"):
        build_tokenizer(os.path.dirname(spec))


def test_dry_run_vocab_falls_back_without_the_tokenizer(tmp_path) -> None:
    from titan_dmuon.components.model import get_model_spec
    from titan_dmuon.config import parse_args
    from titan_dmuon.planner import _vocab_size

    missing = str(tmp_path / "assets" / "tokenizer" / "llama3" / "tokenizer.json")
    cfg = parse_args(["--config", str(REPO / "train_configs" / "llama3_8b.toml"), "--model.tokenizer", missing])
    vocab, source = _vocab_size(cfg, get_model_spec(cfg.model.name))
    assert vocab is None and "not loadable here" in source


@pytest.mark.slow
def test_train_py_with_a_missing_tokenizer_exits_2(tmp_path) -> None:
    missing = tmp_path / "assets" / "tokenizer" / "llama3" / "tokenizer.json"
    argv = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "train.py", *argv, "--model.tokenizer", str(missing)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert f"model.tokenizer: tokenizer file {missing} is missing" in message
    assert "download_hf_assets.py --repo_id" in message and f"--local_dir {missing.parent}" in message
