"""The llama3 Hugging Face adapter and titan_dmuon/components/checkpoint/hf_io.py in one process: names, the RoPE
q/k permutation against an index-by-index reference, config.json against the published Llama 3 sizes, export/load
round trips, sharded files, tied embeddings and the errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from titan_dmuon.components.checkpoint.hf_io import export_hf, hf_tensor_shapes, load_hf_weights
from titan_dmuon.models.llama3 import SPEC, Llama3StateDictAdapter, build_model
from titan_dmuon.models.llama3.state_dict_adapter import permute_from_hf, permute_to_hf

pytest.importorskip("safetensors")

VOCAB = 97  # odd: FSDP shards of the embedding are uneven


def _tiny(n_kv_heads: int | None = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("tinymodel", vocab_size=VOCAB, device="cpu", max_seq_len=32, n_kv_heads=n_kv_heads)


def _reference_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Row by row: our row h*hd + 2i + c (head h, pair i, component c) is HF row h*hd + c*hd/2 + i."""
    hd = w.shape[0] // n_heads
    out = torch.empty_like(w)
    for h in range(n_heads):
        for i in range(hd // 2):
            for c in range(2):
                out[h * hd + c * hd // 2 + i] = w[h * hd + 2 * i + c]
    return out


@pytest.mark.parametrize("n_heads,head_dim", [(4, 16), (2, 8), (1, 2)])
def test_permutation_matches_index_reference_and_round_trips(n_heads, head_dim):
    w = torch.randn(n_heads * head_dim, 5)
    hf = permute_to_hf(w, n_heads)
    assert torch.equal(hf, _reference_to_hf(w, n_heads))
    assert torch.equal(permute_from_hf(hf, n_heads), w)


def test_names_round_trip_and_match_transformers():
    transformers = pytest.importorskip("transformers")
    model = _tiny()
    adapter = SPEC.state_dict_adapter(model)
    assert isinstance(adapter, Llama3StateDictAdapter)
    ours = list(model.state_dict())
    hf_names = [adapter.to_hf_name(k) for k in ours]
    assert len(set(hf_names)) == len(ours)
    assert [adapter.from_hf_name(n) for n in hf_names] == ours
    assert adapter.from_hf_name("model.rotary_emb.inv_freq") is None
    config = transformers.LlamaConfig(**adapter.hf_config())
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(config)
    hf_sd = hf_model.state_dict()
    assert sorted(hf_sd) == sorted(hf_names)
    for k, t in model.state_dict().items():
        assert tuple(hf_sd[adapter.to_hf_name(k)].shape) == tuple(t.shape), k
    wrapped = torch.nn.Module()
    wrapped.module = model  # a DistributedDataParallel-style wrapper
    assert SPEC.state_dict_adapter(wrapped).args is model.args
    with pytest.raises(TypeError, match="expected a llama3 Transformer"):
        SPEC.state_dict_adapter(torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match="no Hugging Face name"):
        adapter.to_hf_name("layers.0.attention.wz.weight")


# intermediate_size of the published Llama 3 / 3.1 / 3.2 config.json files
PUBLISHED_FFN = {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


@pytest.mark.parametrize("flavor", ["1B", "3B", "8B", "70B", "405B"])
def test_config_ffn_size_is_the_models_w1_and_the_published_one(flavor):
    model = build_model(flavor)  # meta: no memory
    config = SPEC.state_dict_adapter(model).hf_config(torch.bfloat16)
    w1 = model.layers["0"].feed_forward.w1.weight
    assert config["intermediate_size"] == w1.shape[0] == PUBLISHED_FFN[flavor]
    a = model.args
    assert config["hidden_size"] == a.dim and config["num_hidden_layers"] == a.n_layers
    assert config["num_attention_heads"] == a.n_heads and config["num_key_value_heads"] == a.n_kv_heads
    assert config["vocab_size"] == 128256 and config["rope_theta"] == 500000
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"


def test_row_ranges_of_q_k_read_only_their_hf_rows(tmp_path):
    """A shard's contiguous range of our q/k rows, cut anywhere (mid-head too), comes from at most two runs of
    HF rows per head it touches, and only those elements are read (the index reference gives the HF layout)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from titan_dmuon.components.checkpoint.hf_io import _hf_rows, _read_rows

    model = _tiny()
    adapter = SPEC.state_dict_adapter(model)
    w = torch.randn(4 * 16, 6)  # 4 heads of head_dim 16, as tinymodel's wq
    save_file({"q": _reference_to_hf(w, 4)}, str(tmp_path / "q.safetensors"))
    rows = _hf_rows(adapter, "layers.0.attention.wq.weight", w.shape[0])
    with safe_open(str(tmp_path / "q.safetensors"), framework="pt") as f:
        sl = f.get_slice("q")

        class _Spy:  # records the elements of each read
            def __init__(self):
                self.reads: list[int] = []

            def __getitem__(self, region):
                t = sl[region]
                self.reads.append(t.numel())
                return t

        for start in range(w.shape[0]):
            for stop in range(start + 1, w.shape[0] + 1):
                for cols in (slice(0, 6), slice(2, 5)):
                    spy = _Spy()
                    got = _read_rows(spy, rows[start:stop], (cols,))
                    assert torch.equal(got, w[start:stop, cols]), (start, stop, cols)
                    assert sum(spy.reads) == got.numel()
                    heads = (stop - 1) // 16 - start // 16 + 1
                    assert len(spy.reads) <= 2 * heads, (start, stop)


def test_export_then_load_is_bitwise_and_permutes_only_q_k(tmp_path):
    model = _tiny()
    sd = model.state_dict()
    adapter = SPEC.state_dict_adapter(model)
    files = export_hf(sd, tmp_path, adapter)
    assert [f.name for f in files] == ["model.safetensors"] and not (tmp_path / "model.safetensors.index.json").exists()
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "model.safetensors"))
    for k, t in sd.items():
        expected = t
        if k.endswith(("wq.weight", "wk.weight")):
            expected = _reference_to_hf(t, 4 if "wq" in k else 2)
            assert not torch.equal(hf[adapter.to_hf_name(k)], t)
        assert torch.equal(hf[adapter.to_hf_name(k)], expected), k
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path, adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k


def test_sharded_export_bf16_and_load_into_fp32(tmp_path):
    model = _tiny()
    sd = model.state_dict()
    adapter = SPEC.state_dict_adapter(model)
    files = export_hf(((k, v) for k, v in sd.items()), tmp_path, adapter, dtype=torch.bfloat16, max_shard_bytes=16_000)
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(adapter.to_hf_name(k) for k in sd)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in sd.values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert hf_tensor_shapes(tmp_path)["model.embed_tokens.weight"] == (VOCAB, 64)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    load_hf_weights(back, tmp_path, adapter)
    for k, t in sd.items():
        assert back[k].dtype == torch.float32 and torch.equal(back[k], t.to(torch.bfloat16).float()), k


def test_tied_embeddings_fill_the_output(tmp_path):
    """Llama 3.2 1B/3B store no lm_head: config.json says tie_word_embeddings and the embedding serves both."""
    model = _tiny()
    sd = model.state_dict()
    adapter = SPEC.state_dict_adapter(model)
    export_hf({k: v for k, v in sd.items() if k != "output.weight"}, tmp_path, adapter)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"no tensor for 1 of the model's weights: output.weight \(lm_head.weight\)"):
        load_hf_weights(back, tmp_path, adapter)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    load_hf_weights(back, tmp_path, adapter)
    assert torch.equal(back["output.weight"], sd["tok_embeddings.weight"])


def test_errors(tmp_path, monkeypatch):
    model = _tiny()
    sd = model.state_dict()
    adapter = SPEC.state_dict_adapter(model)
    with pytest.raises(ValueError, match="holds no \\*.safetensors file"):
        load_hf_weights(sd, tmp_path, adapter)
    export_hf(sd, tmp_path / "a", adapter)
    with pytest.raises(FileExistsError, match="holds HF weights already"):
        export_hf(sd, tmp_path / "a", adapter)
    other = build_model("tinymodel", vocab_size=VOCAB + 1, max_seq_len=32, n_kv_heads=2)  # meta
    with pytest.raises(ValueError, match=r"\(our tok_embeddings.weight\) has shape \[97, 64\] but the model's is"):
        load_hf_weights(other.state_dict(), tmp_path / "a", SPEC.state_dict_adapter(other))
    other = _tiny(n_kv_heads=None)  # 4 kv heads
    with pytest.raises(ValueError, match="num_key_value_heads is 2 in config.json but 4 in the model"):
        load_hf_weights(other.state_dict(), tmp_path / "a", SPEC.state_dict_adapter(other))
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8, "head_dim": 8}))
    with pytest.raises(ValueError, match="num_attention_heads is 8 in config.json but 4 in the model"):
        load_hf_weights(sd, tmp_path / "a", adapter)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        export_hf(sd, tmp_path / "b", adapter)
