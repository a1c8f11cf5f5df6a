"""Llama-3 model: sizes, shapes, causality, meta-device init, GQA."""

from __future__ import annotations

import pytest
import torch

from titan_dmuon.models.llama3 import build_model, get_model_args, llama3_configs
from titan_dmuon.models.llama3.model import Transformer

# 8B, untied: 2 * 128256 * 4096 (embeddings + output) + 4096 (final norm)
#   + 32 * (4096*4096*2 + 4096*1024*2 (attention) + 3 * 4096*14336 (SwiGLU) + 2 * 4096 (norms))
LLAMA3_8B_PARAMS = 8_030_261_248


def _tiny(**kw) -> Transformer:
    args = dict(dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=32)
    args.update(kw)
    torch.manual_seed(0)
    return build_model("debugmodel", vocab_size=50, device="cpu", **args)


def test_8b_param_count_on_meta() -> None:
    model = build_model("8B")
    assert model.args.ffn_hidden_dim == 14336
    assert model.num_params() == LLAMA3_8B_PARAMS
    assert all(p.is_meta for p in model.parameters())
    assert "layers.3.attention.wq.weight" in dict(model.named_parameters())


@pytest.mark.parametrize("flavor,hidden", [("1B", 8192), ("3B", 8192), ("70B", 28672), ("405B", 53248)])
def test_published_ffn_sizes(flavor: str, hidden: int) -> None:
    assert get_model_args(flavor).ffn_hidden_dim == hidden


def test_flavor_table_not_mutated() -> None:
    build_model("debugmodel", vocab_size=300, dim=64)
    assert llama3_configs["debugmodel"].vocab_size == -1 and llama3_configs["debugmodel"].dim == 256


def test_debugmodel_needs_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("debugmodel")


def test_forward_shape_and_flops() -> None:
    model = _tiny()
    logits = model(torch.randint(0, 50, (3, 10)))
    assert logits.shape == (3, 10, 50)
    n = model.num_params(exclude_embedding=True)
    assert model.num_flops_per_token(10) == 6 * n + 12 * 2 * 4 * 8 * 10


def test_causal() -> None:
    model = _tiny()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_meta_build_to_empty_init_is_deterministic() -> None:
    def make() -> dict[str, torch.Tensor]:
        model = build_model("debugmodel", vocab_size=50, dim=32, n_layers=2, n_heads=4, multiple_of=16)
        model.to_empty(device="cpu")
        torch.manual_seed(123)
        model.init_weights()
        return {**model.state_dict(), "rope_cache": model.rope_cache}

    a, b = make(), make()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    torch.manual_seed(123)
    ref = build_model("debugmodel", vocab_size=50, device="cpu", dim=32, n_layers=2, n_heads=4, multiple_of=16)
    torch.testing.assert_close(ref.rope_cache, a["rope_cache"])
    torch.testing.assert_close(ref.state_dict()["output.weight"], a["output.weight"])
    assert "rope_cache" not in ref.state_dict()  # non-persistent buffer
    # depth-scaled init: deeper output projections are smaller
    assert a["layers.1.attention.wo.weight"].std() < a["layers.0.attention.wo.weight"].std()
    assert torch.all(a["output.weight"].abs() <= 3 * 32**-0.5 + 1e-6)


def test_gqa() -> None:
    model = _tiny(n_heads=4, n_kv_heads=2)
    assert model.layers["0"].attention.wk.weight.shape == (16, 32)
    tokens = torch.randint(0, 50, (2, 9))
    logits = model(tokens)
    assert logits.shape == (2, 9, 50)
    logits.sum().backward()
    assert model.layers["1"].attention.wk.weight.grad is not None

    # GQA equals MHA with each kv head duplicated for its query group.
    mha = _tiny(n_heads=4, n_kv_heads=4)
    sd = model.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            sd[key] = sd[key].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens), model(tokens))
