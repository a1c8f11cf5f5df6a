"""Hugging Face interop end to end: a tiny llama3 exported with the adapter is a `transformers` LlamaForCausalLM
with our logits (1e-5, fp32) and imports back bitwise; load_hf_weights fills FSDP2 (and FSDP2 x TP) sharded
DTensor templates on real gloo ranks with exactly the full weights' shards; scripts/convert_checkpoint.py turns a
DCP folder into safetensors that transformers loads, into one torch file, and an HF folder back into DCP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests._scripts import load_script
from titan_dmuon.components.checkpoint.hf_io import export_hf, load_hf_weights
from titan_dmuon.models.llama3 import SPEC, build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, SEQ = 97, 32


def _tiny(n_kv_heads: int | None = 2) -> torch.nn.Module:
    """The tinymodel flavor with peaked attention (q and k scaled up from the init's std 0.02, which leaves
    attention near uniform and RoPE nearly without effect), so a wrong RoPE layout shows in the logits."""
    torch.manual_seed(0)
    model = build_model("tinymodel", vocab_size=VOCAB, device="cpu", max_seq_len=SEQ, n_kv_heads=n_kv_heads)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
    return model


def _hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


def _assert_logits_match(model: torch.nn.Module, folder: Path) -> None:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(folder, tokens)
    assert ours.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [2, None], ids=["gqa", "mha"])
def test_transformers_logits_and_bitwise_import(tmp_path, n_kv_heads):
    model = _tiny(n_kv_heads)
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    export_hf(sd, tmp_path / "one", adapter)
    _assert_logits_match(model, tmp_path / "one")
    files = export_hf(sd, tmp_path / "sharded", adapter, max_shard_bytes=20_000)
    assert len(files) > 1
    _assert_logits_match(model, tmp_path / "sharded")
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "sharded", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    # transformers' own save of the model it loaded imports back bitwise too
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "one"), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "resaved"))
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "resaved", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k


def test_without_the_permutation_logits_differ(tmp_path):
    """The RoPE permutation is what makes the logits agree (the test above would catch a missing one)."""
    model = _tiny()
    adapter = SPEC.state_dict_adapter(model)
    unpermuted = {adapter.to_hf_name(k): v for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file(unpermuted, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (_hf_logits(tmp_path, tokens) - model(tokens)).abs().max() > 1e-2


class _SpyFile:
    """A safetensors file handle that records how many elements of each tensor were read."""

    def __init__(self, handle, log: dict):
        self._f, self._log = handle, log

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        self._log[name] = self._log.get(name, 0) + t.numel()
        return t

    def get_slice(self, name):
        spy, sl = self, self._f.get_slice(name)

        class _Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, region):
                t = sl[region]
                spy._log[name] = spy._log.get(name, 0) + t.numel()
                return t

        return _Slice()


def _load_sharded(rank: int, world_size: int, folder: str, layout: str) -> dict:
    """Build the tiny model on meta, shard it (FSDP2, HSDP 2 x 2, or dp2 x tp2 with FSDP2 over TP), fill it
    with NaN, load the HF folder into its state dict and return every parameter gathered (full_tensor), the
    elements read from the files per tensor and the local elements per tensor."""
    import safetensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reads: dict[str, int] = {}
    safe_open = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _SpyFile(safe_open(*a, **k), reads)
    model = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ, n_kv_heads=2)
    if layout == "fsdp":
        dp = init_device_mesh("cpu", (world_size,))
    elif layout == "hsdp":
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        SPEC.apply_tp(model, mesh["tp"])
        dp = mesh["dp"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    load_hf_weights(sd, folder, SPEC.state_dict_adapter(model))
    adapter = SPEC.state_dict_adapter(model)
    local = {adapter.to_hf_name(k): v.to_local().numel() for k, v in sd.items()}
    placements = {k: str(v.placements) for k, v in sd.items()}
    params = {k: p.full_tensor() for k, p in model.named_parameters()}
    return {"params": params, "placements": placements, "reads": reads, "local": local}


@pytest.mark.slow
@pytest.mark.parametrize("layout,world_size", [("fsdp", 2), ("fsdp", 3), ("hsdp", 4), ("dp_tp", 4)])
def test_load_into_sharded_templates(tmp_path, layout, world_size):
    model = _tiny()
    sd = model.state_dict()
    adapter = SPEC.state_dict_adapter(model)
    export_hf(sd, tmp_path, adapter, max_shard_bytes=20_000)
    results = run_distributed(_load_sharded, world_size, str(tmp_path), layout)
    if layout == "dp_tp":  # FSDP2 over a TP-sharded dim 0 interleaves: the full-matrix path
        assert "_StridedShard" in results[0]["placements"]["layers.0.attention.wq.weight"]
    for r in results:
        assert sorted(r["params"]) == sorted(sd)
        for k, t in sd.items():
            assert torch.equal(r["params"][k], t), k
        # each rank read exactly its share of every tensor, q/k included (on 3 ranks their shards cut heads in
        # the middle); whole matrices only where FSDP2 over TP interleaves the shard (_StridedShard)
        for k, t in sd.items():
            name = adapter.to_hf_name(k)
            whole = "_StridedShard" in r["placements"][k]
            assert r["reads"].get(name, 0) == (t.numel() if whole else r["local"][name]), k


def _save_dcp(model: torch.nn.Module, folder: Path) -> None:
    """A checkpoint as the trainer lays it out: model weights under `model.*`, other state beside them."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict(), "train_state": {"step": torch.tensor(5)}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


TINY_ARGS = ["--model.flavor", "tinymodel", "--training.seq_len", str(SEQ)]
# The checkpoints these tests make have VOCAB ids, fewer than any tokenizer's: weights and config.json alone
WEIGHTS_ONLY = [*TINY_ARGS, "--no-tokenizer"]


def test_convert_checkpoint_dcp_to_hf_torch_and_back(tmp_path, capsys):
    convert = load_script("convert_checkpoint")
    model = _tiny(n_kv_heads=None)  # the tinymodel flavor as the trainer builds it
    sd = model.state_dict()
    step = tmp_path / "checkpoint" / "step-5"
    _save_dcp(model, step)

    # DCP -> HF: shards of at most 20 kB, read in groups of at most that
    assert convert.main([str(step), str(tmp_path / "hf"), "--max-shard-size", "20kB", *WEIGHTS_ONLY]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["max_position_embeddings"] == SEQ
    _assert_logits_match(model, tmp_path / "hf")

    # bf16 export
    assert convert.main([str(step), str(tmp_path / "hf16"), "--export-dtype", "bfloat16", *WEIGHTS_ONLY]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf16" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16

    # DCP -> one torch file, our FQNs
    assert convert.main([str(step), str(tmp_path / "model.pt"), "--format", "torch", *TINY_ARGS]) == 0
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(loaded) == sorted(sd) and all(torch.equal(loaded[k], v) for k, v in sd.items())

    # HF -> DCP, then DCP -> torch again: the weights come back bitwise
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "dcp"), "--format", "dcp", *TINY_ARGS]) == 0
    assert convert.main([str(tmp_path / "dcp"), str(tmp_path / "again.pt"), "--format", "torch", *TINY_ARGS]) == 0
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in sd.items())


class _TouchOnUnpickle:
    """A pickle that, loaded with plain pickle.load, creates the file `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_convert_checkpoint_refuses_metadata_that_would_run_code(tmp_path, capsys):
    import pickle

    convert = load_script("convert_checkpoint")
    # the payload is live: a plain unpickling (DCP's stock FileSystemReader) creates the file
    pickle.loads(pickle.dumps(_TouchOnUnpickle(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()
    step = tmp_path / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    marker = tmp_path / "PWNED"
    (step / ".metadata").write_bytes(pickle.dumps(_TouchOnUnpickle(marker)))
    for fmt, dst in (("hf", tmp_path / "hf"), ("torch", tmp_path / "model.pt")):
        assert convert.main([str(step), str(dst), "--format", fmt, *TINY_ARGS]) == 2
        err = capsys.readouterr().err
        assert f"{step / '.metadata'} is not DCP checkpoint metadata" in err and "nothing was loaded" in err, err
        assert not marker.exists() and not dst.exists()


def test_convert_checkpoint_reads_the_saved_config_and_reports_errors(tmp_path, capsys):
    convert = load_script("convert_checkpoint")
    model = _tiny(n_kv_heads=None)
    step = tmp_path / "checkpoint" / "step-5"
    _save_dcp(model, step)
    # the job's config saved beside the checkpoints supplies flavor and seq_len
    (tmp_path / "checkpoint" / "config.toml").write_text(
        f'[model]\nname = "llama3"\nflavor = "tinymodel"\n\n[training]\nseq_len = {SEQ}\n'
    )
    assert convert.main([str(step), str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    _assert_logits_match(model, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    capsys.readouterr()

    # the config's tokenizer (the byte one, by default) has more ids than this model: not the run's, refused
    assert convert.main([str(step), str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert "has 258 ids but the model" in err and "--no-tokenizer" in err and not (tmp_path / "z").exists(), err
    assert convert.main([str(step), str(tmp_path / "z"), "--model.tokenizer", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "model.tokenizer" in err and "nope.json" in err and not (tmp_path / "z").exists(), err

    assert convert.main([str(tmp_path), str(tmp_path / "x")]) == 2
    assert "is not a DCP checkpoint folder (no .metadata)" in capsys.readouterr().err
    assert convert.main([str(step), str(tmp_path / "y"), "--model.flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err
    assert f"{step} does not hold this model's weights" in err and "other shape" in err
    assert convert.main([str(step), str(tmp_path / "hf"), "--no-tokenizer"]) == 2
    assert "holds HF weights already" in capsys.readouterr().err
