"""The Qwen3 family against `transformers`' Qwen3ForCausalLM (the reference): logits on the same weights (exported
through the adapter, loaded with `from_pretrained`), tied and untied, GQA, head_dim != dim / heads; export -> import
bitwise; KV-cached generation equal to the uncached forward and to transformers' generate, also through
scripts/generate.py; the registry, blocks and Muon matrices; the published sizes; the tied matrix staying one
Parameter. (The activation estimate: tests/integration/test_activation_estimate.py; the TP plan and train.py on
every layout: tests/integration/test_qwen3_train.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from tests._scripts import load_script
from tests.reference import uncached_greedy
from titan_dmuon.components.checkpoint.hf_io import export_hf, load_hf_weights
from titan_dmuon.components.generation import Sampling, generate
from titan_dmuon.components.model import check_flavor, cross_entropy_loss, get_model_spec
from titan_dmuon.models import qwen3
from titan_dmuon.models.qwen3 import SPEC, build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, SEQ = 97, 32
# Published sizes (Qwen/Qwen3-<size> model cards): total and non-embedding parameters, in billions. Their
# non-embedding count leaves out the embedding and, untied, the lm_head too.
PUBLISHED = {
    "0.6B": (0.6, 0.44, True),
    "1.7B": (1.7, 1.4, True),
    "4B": (4.0, 3.6, True),
    "8B": (8.2, 6.95, False),
    "14B": (14.8, 13.2, False),
    "32B": (32.8, 31.2, False),
}


def _tiny(tie: bool = True, n_kv_heads: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """tinymodel (dim 64, 4 heads of 32: attention 128 wide) with peaked attention (q and k scaled up, so RoPE's
    layout shows in the logits) and q/k norm weights away from 1 (so a missing or misplaced norm shows)."""
    torch.manual_seed(0)
    model = build_model(
        "tinymodel", vocab_size=vocab, device="cpu", max_seq_len=SEQ, tie_embeddings=tie, n_kv_heads=n_kv_heads
    )
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
            block.attention.q_norm.weight.uniform_(0.5, 1.5)
            block.attention.k_norm.weight.uniform_(0.5, 1.5)
        model.tok_embeddings.weight.mul_(10)  # tied at std 0.02 the logits are tiny: make them O(1)
    return model


def _hf(folder) -> torch.nn.Module:
    return transformers.Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------- registry
def _muon_params(model) -> list[str]:
    regex = re.compile(SPEC.muon_params)
    return [n for n, p in model.named_parameters() if p.ndim == 2 and regex.search(n)]


def test_spec_blocks_and_muon_matrices() -> None:
    spec = get_model_spec("qwen3")
    assert spec is SPEC and spec.apply_tp is qwen3.apply_tp and spec.loss_fn is cross_entropy_loss
    dense = {"debugmodel", "tinymodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"}
    assert set(spec.flavors) == dense | {"debugmodel_moe", "tinymodel_moe", "30B-A3B", "235B-A22B"}
    with pytest.raises(ValueError, match=r"qwen3 has no flavor 'x'; its flavors: debugmodel, tinymodel, 0.6B"):
        check_flavor(spec, "x")
    for tie in (True, False):
        model = spec.build("tinymodel", vocab_size=64, max_seq_len=16, tie_embeddings=tie)  # meta
        assert all(p.is_meta for p in model.parameters())
        assert [fqn for fqn, _ in spec.blocks(model)] == ["layers.0", "layers.1"]
        assert [b for _, b in spec.blocks(model)] == list(model.layers.values())
        want = [f"layers.{i}.{m}.weight" for i in range(2) for m in ("attention.wq", "attention.wk", "attention.wv")]
        want += [f"layers.{i}.{m}.weight" for i in range(2) for m in ("attention.wo", "feed_forward.w1")]
        want += [f"layers.{i}.feed_forward.{w}.weight" for i in range(2) for w in ("w2", "w3")]
        assert sorted(_muon_params(model)) == sorted(want)  # 14: no norm, embedding or output head
        # every name the regex could take, 1D or not: never the q/k norms
        assert not [n for n, _ in model.named_parameters() if "norm" in n and re.search(spec.muon_params, n)]
        names = [n for n, _ in model.named_parameters()]
        assert ("output.weight" in names) is not tie
        assert (model.output.weight is model.tok_embeddings.weight) is tie
        assert spec.nparams_and_flops(model, 16) == qwen3.get_nparams_and_flops(model, 16)


def test_published_sizes_on_meta() -> None:
    for flavor, (total, non_embedding, tie) in PUBLISHED.items():
        model = build_model(flavor)
        a = model.args
        assert (a.vocab_size, a.head_dim, a.n_kv_heads, a.rope_theta, a.norm_eps) == (151936, 128, 8, 1e6, 1e-6)
        assert a.tie_embeddings is tie and (model.output.weight is model.tok_embeddings.weight) is tie
        n = model.num_params()
        embed = a.vocab_size * a.dim
        assert abs(n / 1e9 - total) / total < 0.02, (flavor, n)
        assert abs((n - embed * (1 if tie else 2)) / 1e9 - non_embedding) / non_embedding < 0.02, (flavor, n)
    # 0.6B exactly: embedding + 28 x (q 2048 + k, v 1024 + o 2048 wide projections, SwiGLU 3 x 1024 x 3072,
    # 2 block norms of 1024, q/k norms of 128) + final norm
    block = 1024 * (2048 + 1024 + 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert build_model("0.6B").num_params() == 151936 * 1024 + 28 * block + 1024 == 596_049_920


def test_flops_count_the_tied_head_as_a_matmul() -> None:
    tied, untied = (build_model("tinymodel", vocab_size=64, tie_embeddings=t) for t in (True, False))
    attention = 12 * 2 * 4 * 32 * 16  # layers x heads x head_dim x seq_len: the attention is 128 wide, dim 64
    assert tied.num_flops_per_token(16) == untied.num_flops_per_token(16)
    assert untied.num_flops_per_token(16) == 6 * untied.num_params(exclude_embedding=True) + attention


# -------------------------------------------------------------------------------- tied weight mechanics
def test_tied_matrix_is_one_parameter_through_to_empty_and_state_dicts() -> None:
    model = build_model("tinymodel", vocab_size=VOCAB)  # meta
    model.to_empty(device="cpu")  # meta -> CPU gives new Parameters: the model ties them again
    assert model.output.weight is model.tok_embeddings.weight
    model.to(torch.float64)
    assert model.output.weight is model.tok_embeddings.weight
    sd = model.state_dict()
    assert "tok_embeddings.weight" in sd and "output.weight" not in sd
    assert list(sd) == [n for n, _ in model.named_parameters()]
    fresh = torch.randn(VOCAB, 64, dtype=torch.float64)
    model.load_state_dict({**sd, "tok_embeddings.weight": fresh})  # strict: output.weight comes with it
    assert torch.equal(model.output.weight, fresh) and model.output.weight is model.tok_embeddings.weight


# ---------------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_transformers_logits_and_bitwise_import(tmp_path, tie):
    model = _tiny(tie)
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    export_hf(sd, tmp_path / "one", adapter)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie and config["head_dim"] == 32 and config["hidden_size"] == 64
    hf = _hf(tmp_path / "one")
    assert type(hf.config).__name__ == "Qwen3Config" and hf.config.num_key_value_heads == 2
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) is tie
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0  # not a degenerate comparison
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # the export holds no lm_head when tied; several files import back bitwise
    files = export_hf(sd, tmp_path / "sharded", adapter, max_shard_bytes=20_000)
    assert len(files) > 1
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in index) is not tie and len(index) == len(sd)
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "sharded", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    # transformers' own save of the model it loaded imports back bitwise too
    hf.save_pretrained(str(tmp_path / "resaved"))
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "resaved", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k


def test_mha_and_untied_import_of_a_tied_folder(tmp_path):
    """Without GQA (kv heads = heads) the logits agree too; an untied model reads a tied folder's embedding as its
    output; a tied model refuses an untied folder (its lm_head would be dropped) and other head counts."""
    model = _tiny(tie=True, n_kv_heads=4)
    export_hf(model.state_dict(), tmp_path / "tied", SPEC.state_dict_adapter(model))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_hf(tmp_path / "tied")(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    untied = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ, n_kv_heads=4, tie_embeddings=False)
    sd = {k: torch.empty(v.shape) for k, v in untied.state_dict().items()}
    load_hf_weights(sd, tmp_path / "tied", SPEC.state_dict_adapter(untied))
    assert torch.equal(sd["output.weight"], model.tok_embeddings.weight)

    other = _tiny(tie=False)
    export_hf(other.state_dict(), tmp_path / "untied", SPEC.state_dict_adapter(other))
    tied = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ)
    sd = {k: torch.empty(v.shape) for k, v in tied.state_dict().items()}
    with pytest.raises(ValueError, match="tie_word_embeddings false"):
        load_hf_weights(sd, tmp_path / "untied", SPEC.state_dict_adapter(tied))
    with pytest.raises(ValueError, match="num_key_value_heads is 4 in config.json but 2"):
        load_hf_weights(sd, tmp_path / "tied", SPEC.state_dict_adapter(tied))


# ------------------------------------------------------------------------------------------ generation


def test_kv_cached_generation_equals_uncached_and_transformers(tmp_path):
    model = _tiny(tie=True)
    prompts = [[5, 17, 3, 9, 44, 2, 71], [8, 1], [60, 61, 62, 63]]  # left-padded to one batch
    n = 12
    out = generate(model, prompts, Sampling(max_new_tokens=n))
    want = [uncached_greedy(model, p, n) for p in prompts]
    assert out.tokens == want
    assert len({tuple(t) for t in want}) == len(prompts)  # not one degenerate continuation
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model))
    hf = _hf(tmp_path)
    for prompt, tokens in zip(prompts, want, strict=True):
        ids = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
        assert ids[0, len(prompt) :].tolist() == tokens


def test_generate_py_on_a_qwen3_export(tmp_path):
    """scripts/generate.py finds the family and flavor of an HF Qwen3 folder by its model_type and shapes (no
    --model.name: the default is llama3) and generates what the model
    does (the byte tokenizer's ids, written beside the weights)."""
    from titan_dmuon.data import build_tokenizer

    tokenizer = build_tokenizer("byte")
    model = _tiny(tie=True, vocab=tokenizer.vocab_size)
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model), tokenizer=tokenizer)
    text = io.StringIO()
    argv = [str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "6", "--ids"]  # family from model_type
    with contextlib.redirect_stdout(text):
        assert load_script("generate").main(argv) == 0
    ids = [[int(t) for t in line.split()[1:]] for line in text.getvalue().splitlines() if line.startswith("ids:")]
    want = uncached_greedy(model, tokenizer.encode("def f(x):", bos=True, eos=False), 6)
    if tokenizer.eos_id in want:
        want = want[: want.index(tokenizer.eos_id)]
    assert ids == [want], text.getvalue()
