"""Hugging Face exports that stand alone, from real train.py checkpoints: scripts/convert_checkpoint.py writes the
run's tokenizer (the byte tokenizer's HF form, or a copy of an HF tokenizer's files), its BOS/EOS/PAD ids in
config.json and generation_config.json, every file with the mode the umask gives; transformers loads the folder
and turns ids into text. `checkpoint.last_save_in_hf` (2 ranks, async save) writes `step-<N>-hf` equal to what
convert_checkpoint makes of the same `step-<N>`."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from tests._scripts import load_script
from tests.train_runs import run_train, tail, tiny_train_argv
from titan_dmuon.data.tokenizer import ByteTokenizer, build_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained by scripts/train_tokenizer.py (300 ids), with a chat template and a
    file that is not the tokenizer's beside it."""
    folder = tmp_path_factory.mktemp("bpe")
    path = load_script("train_tokenizer").train_tokenizer(
        dataset="stdlib", vocab_size=300, max_docs=100, output=str(folder) + os.sep
    )
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / "README.md").write_text("not a tokenizer file")
    return Path(path)


def _train(dump: Path, nproc: int, *extra: str) -> Path:
    """A 2-step tinymodel run saving checkpoints; its checkpoint folder."""
    argv = tiny_train_argv(dump, "--training.steps", "2", "--checkpoint.enable", "true", *extra)
    proc = run_train(nproc, argv)
    assert proc.returncode == 0, tail(proc)
    return dump / "checkpoint"


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(path)))
    return out


def _convert(step: Path, dst: Path, *args: str, umask: int = 0o022) -> None:
    convert = load_script("convert_checkpoint")
    before = os.umask(umask)
    try:
        assert convert.main([str(step), str(dst), *args]) == 0
    finally:
        os.umask(before)


@pytest.mark.slow
def test_convert_a_byte_tokenizer_run(tmp_path):
    step = _train(tmp_path / "run", 1, "--checkpoint.interval", "2") / "step-2"
    _convert(step, tmp_path / "hf", "--max-shard-size", "100kB")
    files = set(os.listdir(tmp_path / "hf"))
    assert TOKENIZER_FILES | {"config.json", "generation_config.json", "model.safetensors.index.json"} <= files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    assert set(_modes(tmp_path / "hf").values()) == {0o644}, _modes(tmp_path / "hf")
    _convert(step, tmp_path / "hf027", umask=0o027)  # the umask decides, not a fixed mode
    assert set(_modes(tmp_path / "hf027").values()) == {0o640}, _modes(tmp_path / "hf027")

    ours = ByteTokenizer()
    ids = {"bos_token_id": ours.bos_id, "eos_token_id": ours.eos_id, "pad_token_id": ours.eos_id}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids and config["vocab_size"] == ours.vocab_size
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == tuple(ids.values())

    # the folder alone turns text into ids and back, and generates text
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Hello, wörld 😀\n  def f(x):"
    assert tok(text)["input_ids"] == ours.encode(text, bos=True, eos=False)
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    prompt = tok("def ", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 5)
    assert tok.decode(out[0], skip_special_tokens=True) == ours.decode(out[0].tolist())


@pytest.mark.slow
def test_convert_an_hf_tokenizer_run(tmp_path, bpe_tokenizer):
    ckpt = _train(tmp_path / "run", 1, "--checkpoint.interval", "2", "--model.tokenizer", str(bpe_tokenizer))
    _convert(ckpt / "step-2", tmp_path / "hf")
    source = bpe_tokenizer.parent
    copied = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert copied <= set(os.listdir(tmp_path / "hf")) and not (tmp_path / "hf" / "README.md").exists()
    for name in copied:
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    assert set(_modes(tmp_path / "hf").values()) == {0o644}, _modes(tmp_path / "hf")

    ours = build_tokenizer(str(bpe_tokenizer))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        ours.bos_id,
        ours.eos_id,
        ours.eos_id,
    )
    assert config["vocab_size"] == ours.vocab_size
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (tok.bos_token_id, tok.eos_token_id) == (ours.bos_id, ours.eos_id)
    text = "import os\n\ndef main():\n    return os.getcwd()  # é"
    assert tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text, bos=False, eos=False)
    assert tok.decode(ours.encode(text), skip_special_tokens=True) == text
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert (generation.bos_token_id, generation.eos_token_id) == (ours.bos_id, ours.eos_id)


@pytest.mark.slow
def test_last_save_in_hf_equals_convert_checkpoint(tmp_path, bpe_tokenizer):
    """2 ranks, an async save every step: only the last one is also written as step-2-hf, once committed, and
    it is what convert_checkpoint writes from step-2 (weights bitwise, configs, tokenizer files)."""
    args = ["--checkpoint.interval", "1", "--checkpoint.async_mode", "async", "--checkpoint.last_save_in_hf", "true"]
    ckpt = _train(tmp_path / "run", 2, *args, "--model.tokenizer", str(bpe_tokenizer))
    assert sorted(os.listdir(ckpt)) == ["step-1", "step-2", "step-2-hf"]
    exported = ckpt / "step-2-hf"
    _convert(ckpt / "step-2", tmp_path / "hf")
    assert sorted(os.listdir(exported)) == sorted(os.listdir(tmp_path / "hf"))
    copied = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert copied | {"generation_config.json", "config.json"} <= set(os.listdir(exported))
    ours, theirs = _tensors(exported), _tensors(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs) and len(ours) > 5
    for name, t in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], t), name
    for name in os.listdir(exported):
        if not name.endswith(".safetensors"):
            assert (exported / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    # readable like the checkpoint's other files (rank 0 wrote both with the same umask)
    config_mode = stat.S_IMODE((ckpt / "step-2" / "config.toml").stat().st_mode)
    assert set(_modes(exported).values()) == {config_mode}, _modes(exported)


@pytest.mark.slow
def test_last_save_in_hf_failure_is_one_clear_error(tmp_path):
    """The conversion fails at its very end (its folder's name is taken by a dangling link, so the rename fails):
    exit 2 with one message naming the folders and the retry command, no temporary left, the checkpoint kept."""
    ckpt = tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "step-2-hf").symlink_to(tmp_path / "nowhere")
    argv = tiny_train_argv(tmp_path / "run", "--training.steps", "2", "--checkpoint.enable", "true")
    proc = run_train(1, [*argv, "--checkpoint.last_save_in_hf", "true"])
    assert proc.returncode == 2, tail(proc)
    assert f"checkpoint.last_save_in_hf: writing {ckpt / 'step-2-hf'} from {ckpt / 'step-2'} failed" in proc.stderr
    assert f"retry with python scripts/convert_checkpoint.py {ckpt / 'step-2'}" in proc.stderr
    assert "Traceback" not in proc.stderr, tail(proc)
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-2-hf"] and (ckpt / "step-2" / ".metadata").is_file()
