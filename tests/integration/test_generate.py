"""From checkpoint to text: scripts/generate.py against Hugging Face transformers on the exported model (its own
tokenizer from the export, its own Llama code, its own generate), for the byte tokenizer and a BPE one; a DCP
checkpoint saved on 4 ranks generates the same tokens from one process and from 2 tensor-parallel ranks."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from tests._dist import run_script
from tests._scripts import load_script
from tests.train_runs import REPO, run_train, tail, tiny_train_argv

PROMPTS = ["Hello, world", "The quick brown fox jumps over"]  # different lengths: one left-padded batch
NEW_TOKENS = 20


def _train(tmp_path, nproc: int, *extra: str):
    """A tinymodel trained 4 steps and saved: its step folder."""
    argv = tiny_train_argv(tmp_path / "run", "--training.steps", "4", "--checkpoint.enable", "true", *extra)
    proc = run_train(nproc, [*argv, "--checkpoint.interval", "4"])
    assert proc.returncode == 0, tail(proc)
    return tmp_path / "run" / "checkpoint" / "step-4"


def _export(step, dst) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert load_script("convert_checkpoint").main([str(step), str(dst)]) == 0


def _ids(stdout: str) -> list[list[int]]:
    return [[int(t) for t in line.split()[1:]] for line in stdout.splitlines() if line.startswith("ids:")]


def _generate_py(src, *extra: str) -> list[list[int]]:
    """scripts/generate.py in this process, greedy, both prompts in one batch: each prompt's new token ids."""
    out = io.StringIO()
    argv = [str(src), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", str(NEW_TOKENS), "--ids"]
    with contextlib.redirect_stdout(out):
        assert load_script("generate").main([*argv, *extra]) == 0
    ids = _ids(out.getvalue())
    assert len(ids) == len(PROMPTS), out.getvalue()
    return ids


def _transformers(folder) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, new token ids) of transformers' greedy generation, each prompt alone, with the tokenizer and
    the model loaded from the exported folder only (AutoTokenizer, AutoModelForCausalLM)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, new = [], []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(ids) :].tolist()
        if model.generation_config.eos_token_id in out:  # generate.py stops before EOS, transformers after it
            out = out[: out.index(model.generation_config.eos_token_id)]
        prompts.append(ids)
        new.append(out)
    return prompts, new


def _prompt_ids(step) -> list[list[int]]:
    """The run's own tokenization of the prompts (generate.py feeds `encode(text, bos=True, eos=False)`)."""
    from titan_dmuon.config import parse_args
    from titan_dmuon.data import build_tokenizer

    config = next(p for p in (step / "config.toml", step.parent / "config.toml") if p.is_file())
    tokenizer = build_tokenizer(parse_args(["--config", str(config)]).model.tokenizer)
    return [tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]


@pytest.mark.slow
def test_a_4_rank_checkpoint_generates_what_transformers_does_from_its_export(tmp_path) -> None:
    """Byte tokenizer; DMuon on 2 DP x 2 TP ranks. transformers' tokens on the export equal generate.py's from the
    DCP folder in one process, from the export, and from the DCP folder on 2 TP ranks."""
    step = _train(tmp_path, 4, "--parallelism.tensor_parallel_degree", "2")
    _export(step, tmp_path / "hf")
    prompt_ids, want = _transformers(tmp_path / "hf")
    assert prompt_ids == _prompt_ids(step)
    assert sum(map(len, want)) > NEW_TOKENS  # not a model that stops at once: the comparison has tokens in it
    assert _generate_py(step) == want
    assert _generate_py(tmp_path / "hf") == want
    argv = [str(step), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", str(NEW_TOKENS), "--ids"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_script(2, "scripts/generate.py", argv, cwd=str(REPO), env=env, timeout=300)
    assert proc.returncode == 0, tail(proc)
    assert _ids(proc.stdout) == want, tail(proc)
    assert "tokens/s" in proc.stdout and "2 rank(s)" in proc.stdout


@pytest.mark.slow
def test_a_bpe_tokenizer_run_generates_what_transformers_does_from_its_export(tmp_path) -> None:
    tokenizer = load_script("train_tokenizer").train_tokenizer(
        dataset="stdlib", vocab_size=320, max_docs=100, output=str(tmp_path / "tok") + os.sep
    )
    step = _train(tmp_path, 1, "--model.tokenizer", os.path.dirname(tokenizer))
    _export(step, tmp_path / "hf")
    prompt_ids, want = _transformers(tmp_path / "hf")
    assert prompt_ids == _prompt_ids(step)
    assert _generate_py(step) == want
    assert _generate_py(tmp_path / "hf") == want


@pytest.mark.slow
def test_a_padded_vocabulary_run_generates_what_transformers_does_from_its_export(tmp_path) -> None:
    """model.vocab_size 320 for the byte tokenizer's 258 ids (as Qwen3 pads 151,669 ids to 151,936 rows): the
    checkpoint's embedding has 320 rows; generate.py takes that size from the run's saved config.toml (the
    tokenizer's 258 would not load it), the export's config.json says 320, and both generate transformers' tokens."""
    import json

    from tests.train_runs import read_checkpoint

    step = _train(tmp_path, 1, "--model.vocab_size", "320")
    assert read_checkpoint(step)["model.tok_embeddings.weight"].shape == (320, 64)
    _export(step, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 320
    prompt_ids, want = _transformers(tmp_path / "hf")
    assert prompt_ids == _prompt_ids(step)
    assert sum(map(len, want)) > NEW_TOKENS
    assert _generate_py(step) == want
    assert _generate_py(tmp_path / "hf") == want


def test_errors_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    generate = load_script("generate")
    assert generate.main([str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a DCP checkpoint" in capsys.readouterr().err
    assert generate.main([str(tmp_path)]) == 2
    assert "no prompt" in capsys.readouterr().err
