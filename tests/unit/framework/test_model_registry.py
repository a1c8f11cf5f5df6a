"""The model registry: ModelSpecs of llama3 and tiny_mlp, unknown names and flavors listing what exists."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import titan_dmuon.models.llama3 as llama3
from titan_dmuon.components.model import (
    available_models,
    check_flavor,
    cross_entropy_loss,
    get_model_spec,
    model_vocab_size,
    register_model_spec,
)
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.models.tiny_mlp import TinyMLP, is_muon_target


def _muon_params(spec, model) -> list[str]:
    regex = re.compile(spec.muon_params)
    return [n for n, p in model.named_parameters() if p.ndim == 2 and regex.search(n)]


def test_unknown_family_and_flavor_list_what_exists() -> None:
    assert {"llama3", "tiny_mlp"} <= set(available_models())
    families = r"unknown model family 'gpt9'; registered families: .*llama3, qwen3, tiny_mlp"
    with pytest.raises(ValueError, match=families):
        get_model_spec("gpt9")
    with pytest.raises(ValueError, match=r"unknown model family '\.\./x'"):  # never imported as a path
        get_model_spec("../x")
    flavors = "debugmodel, tinymodel, tinymodel_gqa, 1B"
    with pytest.raises(ValueError, match=rf"llama3 has no flavor 'hugemodel'; its flavors: {flavors}"):
        check_flavor(get_model_spec("llama3"), "hugemodel")
    with pytest.raises(ValueError, match="registered already"):
        register_model_spec(dataclasses.replace(llama3.SPEC, flavors={}))


def test_llama3_spec() -> None:
    spec = get_model_spec("llama3")
    assert spec is llama3.SPEC and spec.apply_tp is llama3.apply_tp and spec.loss_fn is cross_entropy_loss
    assert set(spec.flavors) == {"debugmodel", "tinymodel", "tinymodel_gqa", "1B", "3B", "8B", "70B", "405B"}
    model = spec.build("tinymodel", vocab_size=64, max_seq_len=16)  # meta
    assert all(p.is_meta for p in model.parameters())
    assert [fqn for fqn, _ in spec.blocks(model)] == ["layers.0", "layers.1"]
    assert [b for _, b in spec.blocks(model)] == list(model.layers.values())
    assert len(_muon_params(spec, model)) == 14  # 2 x (wq wk wv wo w1 w2 w3)
    assert spec.nparams_and_flops(model, 16) == llama3.get_nparams_and_flops(model, 16)


def test_tiny_mlp_spec_trains_a_token_model() -> None:
    spec = get_model_spec("tiny_mlp")
    assert spec.apply_tp is None and set(spec.flavors) == {"debugmodel", "tinymodel"}
    model = spec.build("tinymodel", vocab_size=40, max_seq_len=16)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    assert [fqn for fqn, _ in spec.blocks(model)] == ["layers.0", "layers.1"]
    assert sorted(_muon_params(spec, model)) == [
        f"layers.{i}.{w}_proj.weight" for i in range(2) for w in ("down", "gate", "up")
    ]
    n, flops = spec.nparams_and_flops(model, 16)
    assert n == sum(p.numel() for p in model.parameters()) and flops == 6 * (n - 40 * 64)
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 16, 40)
    loss = spec.loss_fn(logits, tokens)
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(40.0)).item()) < 2.0


def test_quickstart_tiny_mlp_unchanged() -> None:
    """titan_dmuon.models.tiny_mlp still exports the quick-start TinyMLP (a scalar loss of a float input) and its
    predicate."""
    torch.manual_seed(0)
    model = TinyMLP(d=8, ff=16, n_layers=2)
    assert model(torch.randn(3, 8)).ndim == 0
    assert [n for n, p in model.named_parameters() if is_muon_target(n, p)] == [
        f"layers.{i}.{w}_proj.weight" for i in range(2) for w in ("gate", "up", "down")
    ]


def test_vocab_size_from_the_config_an_hf_folder_or_the_tokenizer(tmp_path) -> None:
    """Published checkpoints pad their vocabulary past the tokenizer's ids; a size below the ids is an error."""
    cfg = JobConfig()
    assert model_vocab_size(cfg, 258) == 258
    (tmp_path / "config.json").write_text('{"vocab_size": 320}')
    cfg.checkpoint.initial_load_path = str(tmp_path)
    assert model_vocab_size(cfg, 258) == 320
    cfg.model.vocab_size = 384  # the user's choice wins over the folder's
    assert model_vocab_size(cfg, 258) == 384
    with pytest.raises(ConfigError, match=r"model.vocab_size is 384, but the tokenizer 'byte' has 400 ids"):
        model_vocab_size(cfg, 400)
    cfg.model.vocab_size = 0
    with pytest.raises(ConfigError, match=r"vocab_size in .*config.json is 320, but the tokenizer 'byte' has 400 ids"):
        model_vocab_size(cfg, 400)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        model_vocab_size(cfg, 258)
