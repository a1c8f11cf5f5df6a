"""DeepSeek-V3 (titan_dmuon/models/deepseek_v3/, with common/mla.py, common/moe.py's DeepSeekMoE and common/rope.py's
Yarn) against `transformers`' DeepseekV3ForCausalLM: the flavors, blocks, Muon regex and per-head blocks; the
published shapes' parameter counts (against the published figures and a count written here from the config fields)
and FLOPs; logits on our exported weights (fp32; with and without a query latent, YaRN with a cos/sin factor and a
softmax scale both away from 1), export -> import bitwise, transformers' own save read back, a folder with
DeepSeek-V3's multi-token-prediction layer, config.json checks; the router against HF's; the latent KV cache
against the uncached forward (left-padded prompts), scripts/generate.py against transformers' greedy generate; and
train.py starting from an HF folder (checkpoint.initial_load_path).

The tiny model's weights are scaled so that each part shows in the logits: peaked attention with a large output, a
rotary key as large as the latent's keys, norm weights away from 1, a router whose sigmoid scores spread over (0, 1)
with a non-zero selection bias, and group-limited routing (8 experts in 4 groups, 2 searched) that changes the choice
for some tokens (each asserted where it is used)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re

import pytest
import torch

from tests._scripts import load_script
from tests.reference import uncached_greedy
from titan_dmuon.components.checkpoint.hf_io import export_hf, load_hf_weights
from titan_dmuon.components.generation import Sampling, generate
from titan_dmuon.components.kv_cache import KVCache
from titan_dmuon.components.model import get_model_spec
from titan_dmuon.components.moe import MoELayer, moe_layers
from titan_dmuon.models.common.feed_forward import FeedForward
from titan_dmuon.models.common.moe import MoE, Router
from titan_dmuon.models.common.rope import Yarn
from titan_dmuon.models.deepseek_v3 import MUON_PARAMS, SPEC, build_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

VOCAB, SEQ = 97, 32
# A YaRN whose ramp has pairs of all three kinds on tinymodel's 8 rotary dims (4 pairs: 0 and 1 extrapolated, 2
# blended, 3 interpolated: the small betas put the ramp's bounds there for an original context of 8), with the
# original context below SEQ, and mscale != mscale_all_dim: cos/sin carry mscale(4, 1) / mscale(4, 0.5) ~ 1.065 and
# the softmax scale mscale(4, 0.5)^2 ~ 1.143.
YARN = Yarn(factor=4, original_max_position_embeddings=8, beta_fast=0.1, beta_slow=0.01, mscale=1.0, mscale_all_dim=0.5)


def _tiny(vocab: int = VOCAB, seed: int = 0, **overrides) -> torch.nn.Module:
    """tinymodel (layer 0 dense, layer 1 DeepSeekMoE: 8 experts in 4 groups of which 2 are searched, top 2, one
    shared expert, routed_scaling_factor 2.5) with weights that make every part visible (module docstring)."""
    torch.manual_seed(seed)
    model = build_model("tinymodel", vocab_size=vocab, device="cpu", max_seq_len=SEQ, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.layers.values():
            a = block.attention
            getattr(a, a.q_proj).weight.mul_(4)
            a.wo.weight.mul_(10)  # depth-scaled init: make attention's share of the logits visible
            a.wkv_a.weight[a.kv_lora_rank :].mul_(8)  # the rotary key: no norm after it, so as large as the latent's
            a.kv_norm.weight.copy_(torch.rand(a.kv_lora_rank, generator=g) + 0.5)
            if a.q_norm is not None:
                a.q_norm.weight.copy_(torch.rand(a.q_lora_rank, generator=g) + 0.5)
            if not isinstance(block.feed_forward, MoE):
                block.feed_forward.w2.weight.mul_(10)
        for moe in moe_layers(model):
            moe.router.gate.weight.mul_(15)
            moe.router.expert_bias.copy_(torch.randn(moe.num_experts, generator=g) * 0.1)
            moe.experts.w2.mul_(10)  # depth-scaled init: make the experts' share of the logits visible
            moe.shared_experts.w2.weight.mul_(10)
    return model


def _tokens(seed: int = 1, batch: int = 2, vocab: int = VOCAB, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf(folder) -> torch.nn.Module:
    return transformers.DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _router_inputs(model, tokens: torch.Tensor) -> torch.Tensor:
    """The MoE layer's input rows [B*T, dim] on `tokens`."""
    seen = []
    moe = model.layers["1"].feed_forward
    handle = moe.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    return seen[0]


def _changed_choices(router: Router, x: torch.Tensor, **changes) -> int:
    """Tokens whose expert set differs when the router's attributes (or its bias) take `changes`."""
    with torch.no_grad():
        want = router(x)[2].sort(-1).values
        saved = {k: getattr(router, k) for k in changes if k != "expert_bias"}
        bias = router.expert_bias.clone()
        for k, v in changes.items():
            if k == "expert_bias":
                router.expert_bias.copy_(v)
            else:
                setattr(router, k, v)
        got = router(x)[2].sort(-1).values
        router.expert_bias.copy_(bias)
        for k, v in saved.items():
            setattr(router, k, v)
    return int((got != want).any(-1).sum())


# --------------------------------------------------------------------------------------- flavors and blocks
def _expected_muon(model) -> set[str]:
    """Every matrix Muon should take, listed from the config: MLA's projections, the dense SwiGLU, the shared
    expert's SwiGLU and the routed expert stacks."""
    a, out = model.args, set()
    for i in range(a.n_layers):
        q = ("wq_a", "wq_b") if a.q_lora_rank else ("wq",)
        out |= {f"layers.{i}.attention.{w}.weight" for w in (*q, "wkv_a", "wkv_b", "wo")}
        if a.is_moe_layer(i):
            out |= {f"layers.{i}.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")}
            out |= {f"layers.{i}.feed_forward.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
        else:
            out |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    return out


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["q_lora", "no_q_lora"])
def test_flavors_blocks_and_muon_params(q_lora_rank) -> None:
    assert get_model_spec("deepseek_v3") is SPEC and SPEC.muon_params == MUON_PARAMS
    assert {"debugmodel", "tinymodel", "moonlight_16b_a3b", "671B", "kimi_k2"} <= set(SPEC.flavors)
    model = SPEC.build("tinymodel", vocab_size=64, max_seq_len=16, q_lora_rank=q_lora_rank)  # meta
    ff = [b.feed_forward for b in model.layers.values()]
    assert [type(f) for f in ff] == [FeedForward, MoE]  # a dense first layer, then DeepSeekMoE
    assert moe_layers(model) == [ff[1]] and isinstance(ff[1], MoELayer)
    assert [fqn for fqn, _ in SPEC.blocks(model)] == ["layers.0", "layers.1"]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.1.feed_forward")}
    assert shapes == {
        "layers.1.feed_forward.router.gate.weight": (8, 64),
        "layers.1.feed_forward.experts.w1": (8, 32, 64),
        "layers.1.feed_forward.experts.w2": (8, 64, 32),
        "layers.1.feed_forward.experts.w3": (8, 32, 64),
        "layers.1.feed_forward.shared_experts.w1.weight": (32, 64),
        "layers.1.feed_forward.shared_experts.w2.weight": (64, 32),
        "layers.1.feed_forward.shared_experts.w3.weight": (32, 64),
    }
    muon = {n for n, _ in model.named_parameters() if re.search(SPEC.muon_params, n)}
    assert muon == _expected_muon(model)
    others = {n for n, _ in model.named_parameters()} - muon
    # AdamW: the embedding, the output, the norms (MLA's q_norm / kv_norm too), the router's gate
    assert all(re.search(r"^(tok_embeddings|output)\.|norm\.weight$|router\.gate\.weight$", n) for n in others)
    assert {"tok_embeddings.weight", "output.weight", "layers.1.feed_forward.router.gate.weight"} <= others
    assert ("layers.0.attention.q_norm.weight" in others) == bool(q_lora_rank)
    assert "layers.1.feed_forward.router.expert_bias" in model.state_dict()  # a persistent buffer, no param
    assert "layers.1.feed_forward.router.expert_bias" not in dict(model.named_parameters())

    # the published shapes: the dense first layers, then MoE ones; shared experts n_shared_experts wide
    for flavor, dense, shared in (("671B", 3, 2048), ("kimi_k2", 1, 2048), ("moonlight_16b_a3b", 1, 2 * 1408)):
        big = build_model(flavor)
        kinds = [isinstance(b.feed_forward, MoE) for b in big.layers.values()]
        assert kinds == [False] * dense + [True] * (big.args.n_layers - dense), flavor
        assert big.layers[str(dense)].feed_forward.shared_experts.w1.weight.shape == (shared, big.args.dim)
        assert {n for n, _ in big.named_parameters() if re.search(SPEC.muon_params, n)} == _expected_muon(big)


def test_head_blocks_are_the_heads() -> None:
    """SPEC.head_blocks: a head's rows of the query projection (qk_head_dim) and of wkv_b (nope + v), its columns
    of wo (v_head_dim). Widths all different here, and checked on the model: perturbing head h's block of the query
    projection or of wkv_b changes exactly the columns of wo's block h in wo's input."""
    model = build_model(
        "tinymodel", vocab_size=VOCAB, device="cpu", max_seq_len=SEQ, qk_nope_head_dim=12, qk_rope_head_dim=8
    )  # qk_head_dim 20, nope + v 28, v 16
    blocks = SPEC.head_blocks(model)
    assert blocks == {
        f"layers.{i}.attention.{w}.weight": b
        for i in (0, 1)
        for w, b in (("wq_b", (0, 20)), ("wkv_b", (0, 28)), ("wo", (1, 16)))
    }
    no_q_lora = SPEC.build("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ, q_lora_rank=0)
    assert SPEC.head_blocks(no_q_lora)["layers.1.attention.wq.weight"] == (0, 24)
    big = SPEC.head_blocks(build_model("671B"))
    assert (big["layers.60.attention.wq_b.weight"], big["layers.0.attention.wkv_b.weight"]) == ((0, 192), (0, 256))
    assert big["layers.3.attention.wo.weight"] == (1, 128)

    attn = model.layers["0"].attention
    heads, v = attn.n_heads, blocks["layers.0.attention.wo.weight"][1]
    assert attn.wo.weight.shape[1] == heads * v
    seen = []
    attn.wo.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    x = torch.randn(2, SEQ, model.args.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attn(x, model.rope_cache)
        base = seen.pop()
        for name in ("wq_b", "wkv_b"):
            dim, size = blocks[f"layers.0.attention.{name}.weight"]
            w = getattr(attn, name).weight
            assert dim == 0 and w.shape[0] == heads * size
            for h in range(heads):
                saved = w.clone()
                w[h * size : (h + 1) * size] += 0.5
                attn(x, model.rope_cache)
                w.copy_(saved)
                changed = (seen.pop() - base).abs().amax((0, 1)) > 1e-6
                want = torch.zeros(heads * v, dtype=torch.bool)
                want[h * v : (h + 1) * v] = True
                assert torch.equal(changed, want), (name, h)


# --------------------------------------------------------------------------------------- published sizes
def _count(a) -> tuple[int, int]:
    """(total, active) parameters from the config fields, written out: MLA (query down/norm/up or one query
    projection; wkv_a to the latent and the rotary key, its norm, wkv_b to each head's key and value; wo), the
    block's two norms, the dense SwiGLU or the router gate, the routed experts and the shared SwiGLU; the embedding,
    the final norm and the untied output. Active: top_k of the routed experts."""
    d, h = a.dim, a.n_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else d * h * qk
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank + a.kv_lora_rank * h * (qk - a.qk_rope_head_dim)
    kv += a.kv_lora_rank * h * a.v_head_dim
    attention = q + kv + h * a.v_head_dim * d + 2 * d
    n_moe = a.n_layers - a.first_k_dense_replace
    expert = 3 * d * a.moe_hidden_dim
    moe = attention + a.num_experts * d + a.num_experts * expert + a.n_shared_experts * expert
    dense = attention + 3 * d * a.ffn_hidden_dim
    total = 2 * a.vocab_size * d + d + a.first_k_dense_replace * dense + n_moe * moe
    return total, total - n_moe * (a.num_experts - a.top_k) * expert


# (flavor, published total, published active, whether the published figures leave the embedding and the output out,
# tolerance on the total, on the active count). Our counts, for the record:
#   671B: 671.03B total, 37.55B active. DeepSeek-V3's report: 671B total, 37B activated per token; its Hugging Face
#     repository holds 685B: the 14B more are the multi-token-prediction module (model.layers.61), not built here.
#   kimi_k2: 1026.4B total, 32.86B active. Kimi K2's report: 1.04T total, 32B activated.
#   moonlight_16b_a3b: 15.96B total, 2.91B active (the name's 16B and A3B); without the embedding and the output
#     head (2 x 163840 x 2048) 15.29B and 2.24B, the Moonlight report's figures.
PUBLISHED = [
    ("671B", 671e9, 37e9, False, 0.001, 0.02),
    ("kimi_k2", 1.04e12, 32e9, False, 0.015, 0.03),
    ("moonlight_16b_a3b", 15.29e9, 2.24e9, True, 0.001, 0.003),
]


@pytest.mark.parametrize("flavor, total, active, no_embeddings, tol_total, tol_active", PUBLISHED)
def test_published_sizes_on_meta(flavor, total, active, no_embeddings, tol_total, tol_active) -> None:
    model = build_model(flavor)
    a = model.args
    assert model.num_params() < 2e12 and all(p.is_meta for p in model.parameters())
    assert (model.num_params(), model.num_active_params()) == _count(a)
    embeddings = 2 * a.vocab_size * a.dim if no_embeddings else 0
    assert abs((model.num_params() - embeddings) / total - 1) < tol_total, model.num_params()
    assert abs((model.num_active_params() - embeddings) / active - 1) < tol_active, model.num_active_params()
    # FLOPs per token: 6 x the active matmul params (all but the embedding lookup) + the attention's scores over
    # qk_head_dim and values over v_head_dim
    seq = 4096
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    want = 6 * (_count(a)[1] - a.vocab_size * a.dim) + 6 * a.n_layers * a.n_heads * (qk + a.v_head_dim) * seq
    assert model.num_flops_per_token(seq) == want
    assert SPEC.nparams_and_flops(model, seq) == (model.num_params(), want)


def test_published_configs() -> None:
    """The flavors' fields that config.json publishes (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Base,
    moonshotai/Moonlight-16B-A3B), and the softmax scale YaRN implies (transformers' yarn_get_mscale written out)."""
    keys = "vocab_size dim n_layers n_heads q_lora_rank kv_lora_rank num_experts top_k moe_hidden_dim".split()
    keys += "n_shared_experts first_k_dense_replace n_group topk_group routed_scaling_factor rope_theta".split()
    want = {
        "671B": (129280, 7168, 61, 128, 1536, 512, 256, 8, 2048, 1, 3, 8, 4, 2.5, 10000.0),
        "kimi_k2": (163840, 7168, 61, 64, 1536, 512, 384, 8, 2048, 1, 1, 1, 1, 2.827, 50000.0),
        "moonlight_16b_a3b": (163840, 2048, 27, 16, 0, 512, 64, 6, 1408, 2, 1, 1, 1, 2.446, 50000.0),
    }
    for flavor, values in want.items():
        model = build_model(flavor)
        a = model.args
        assert tuple(getattr(a, k) for k in keys) == values, flavor
        assert (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.norm_topk_prob) == (128, 64, 128, True)
        scale = 192**-0.5
        if a.rope_scaling is not None:
            scale *= (0.1 * a.rope_scaling.mscale_all_dim * math.log(a.rope_scaling.factor) + 1) ** 2
        assert model.layers["0"].attention.softmax_scale == pytest.approx(scale, rel=1e-12)
    assert build_model("671B").args.rope_scaling.hf() | {"type": "yarn"} == {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert build_model("moonlight_16b_a3b").args.rope_scaling is None


# --------------------------------------------------------------------------------------- transformers parity
# "moonlight_eps": Moonlight's rms_norm_eps 1e-5 is the blocks' norms' only (HF builds the latent norms with 1e-6),
# with latents narrow and small enough that the eps shows
PARITY = {
    "q_lora": {},
    "no_q_lora": {"q_lora_rank": 0},
    "yarn": {"rope_scaling": YARN},
    "moonlight_eps": {"norm_eps": 1e-5, "q_lora_rank": 8, "kv_lora_rank": 8},
}


@pytest.mark.parametrize("case", list(PARITY))
def test_transformers_logits(tmp_path, case) -> None:
    model = _tiny(**PARITY[case])
    if case == "moonlight_eps":  # latents whose mean square is near the eps
        with torch.no_grad():
            for block in model.layers.values():
                block.attention.wq_a.weight.mul_(0.01)
                block.attention.wkv_a.weight[: block.attention.kv_lora_rank].mul_(0.01)
    tokens = _tokens()
    router = model.layers["1"].feed_forward.router
    x = _router_inputs(model, tokens)
    # the inputs show the routing rules: group limiting and the selection bias each change some tokens' experts
    assert (router.n_group, router.topk_group, router.route_scale) == (4, 2, 2.5)
    assert _changed_choices(router, x, n_group=1) > 0
    assert _changed_choices(router, x, expert_bias=torch.zeros(8)) > 0
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["q_lora_rank"] == (PARITY[case].get("q_lora_rank", 32) or None)
    keys = ("n_routed_experts", "n_group", "topk_group", "first_k_dense_replace", "n_shared_experts", "kv_lora_rank")
    assert [config[k] for k in keys] == [8, 4, 2, 1, 1, PARITY[case].get("kv_lora_rank", 32)]
    assert config["rope_interleave"] is True and config["routed_scaling_factor"] == 2.5
    hf = _hf(tmp_path)
    assert type(hf.model.layers[0].mlp) is hf_ds.DeepseekV3MLP and type(hf.model.layers[1].mlp) is hf_ds.DeepseekV3MoE
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(model.layers["0"].attention.softmax_scale, rel=1e-12)
    if case == "yarn":  # both YaRN factors away from 1, and the ramp has pairs of each kind
        assert hf.model.rotary_emb.attention_scaling == pytest.approx(YARN.attention_factor, rel=1e-12)
        assert YARN.attention_factor > 1.05 and model.layers["0"].attention.softmax_scale * 24**0.5 > 1.1
        ratio = (YARN.inv_freq(8, 1e4) / (1e4 ** -(torch.arange(0, 8, 2) / 8))).tolist()
        assert ratio[:2] == pytest.approx([1, 1]) and 0.3 < ratio[2] < 0.9 and ratio[3] == pytest.approx(0.25)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    if case == "moonlight_eps":  # the latent norms with the blocks' eps would be visibly off
        for block in model.layers.values():
            block.attention.q_norm.eps = block.attention.kv_norm.eps = 1e-5
        with torch.no_grad():
            assert (model(tokens) - theirs).abs().max() > 1e-3
    if case == "yarn":  # the same weights without the scaling: other logits (YaRN is visible at this length)
        plain = build_model("tinymodel", vocab_size=VOCAB, device="cpu", max_seq_len=SEQ)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - ours).abs().max() > 1e-3


def test_export_import_bitwise_and_published_names(tmp_path) -> None:
    model = _tiny()
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    files = export_hf(sd, tmp_path / "sharded", adapter, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and len(set(index.values())) == len(files)
    names = {
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",  # non-zero here
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "lm_head.weight",
    }
    assert names <= set(index)
    assert len(index) == len(sd) - 3 + 3 * 8  # the three stacks as 8 matrices each
    for name, (fqn, e) in {  # each expert's matrix is its slice of our stack
        "model.layers.1.mlp.experts.0.gate_proj.weight": ("w1", 0),
        "model.layers.1.mlp.experts.3.up_proj.weight": ("w3", 3),
        "model.layers.1.mlp.experts.7.down_proj.weight": ("w2", 7),
    }.items():
        with safetensors_torch.safe_open(str(tmp_path / "sharded" / index[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), sd[f"layers.1.feed_forward.experts.{fqn}"][e]), name
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "sharded", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    # transformers' own save (its fused experts, per expert on disk) read back
    export_hf(sd, tmp_path / "one", adapter)
    _hf(tmp_path / "one").save_pretrained(str(tmp_path / "resaved"))
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "resaved", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    # a zero selection bias is left out (what a folder without one means) and read back as zeros
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias.zero_()
    export_hf(model.state_dict(), tmp_path / "zero_bias", adapter)
    assert not [n for n in adapter.to_hf_state_dict(model.state_dict()) if "bias" in n]
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "zero_bias", adapter)
    assert not back["layers.1.feed_forward.router.expert_bias"].any()


def test_a_folder_with_the_mtp_layer_imports_without_it(tmp_path) -> None:
    """DeepSeek-V3's checkpoint holds its multi-token-prediction module as one more layer, model.layers.{n_layers}
    (a decoder layer with experts, and enorm / hnorm / eh_proj / shared_head): its names are skipped."""
    model = _tiny()
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    hf_sd = adapter.to_hf_state_dict(sd)
    g = torch.Generator().manual_seed(3)
    mtp = {n.replace("model.layers.1.", "model.layers.2."): torch.randn(t.shape, generator=g) for n, t in hf_sd.items()}
    mtp = {n: t for n, t in mtp.items() if n.startswith("model.layers.2.")}
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128))):
        mtp[f"model.layers.2.{name}"] = torch.randn(shape, generator=g)
    mtp["model.layers.2.shared_head.norm.weight"] = torch.randn(64, generator=g)
    mtp["model.layers.2.shared_head.head.weight"] = torch.randn(VOCAB, 64, generator=g)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in mtp
    config = adapter.hf_config() | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({**hf_sd, **mtp}, str(tmp_path / "model.safetensors"))
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path, adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    assert all(adapter.from_hf_name(n) is None for n in mtp)
    converted = adapter.from_hf_state_dict({**hf_sd, **mtp})
    assert set(converted) == set(sd) and all(torch.equal(converted[k], t) for k, t in sd.items())


def test_check_hf_config_refuses_other_rope_scaling_and_kv_lora_rank(tmp_path) -> None:
    plain, yarn = _tiny(), _tiny(rope_scaling=YARN)
    export_hf(plain.state_dict(), tmp_path / "plain", SPEC.state_dict_adapter(plain))
    export_hf(yarn.state_dict(), tmp_path / "yarn", SPEC.state_dict_adapter(yarn))

    def load(folder, **overrides):
        model = SPEC.build("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ, **overrides)
        sd = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
        load_hf_weights(sd, tmp_path / folder, SPEC.state_dict_adapter(model))
        return sd

    assert torch.equal(load("yarn", rope_scaling=YARN)["output.weight"], yarn.output.weight)
    assert torch.equal(load("plain")["output.weight"], plain.output.weight)
    rope = r"config.json's RoPE scaling .* is not the model's .*the model config \(flavor\) does not match"
    with pytest.raises(ValueError, match=rope):
        load("plain", rope_scaling=YARN)  # a plain folder into a YaRN model
    with pytest.raises(ValueError, match=rope):
        load("yarn")  # and the other way
    # the same factor, other fields: each changes the frequencies, the cos/sin factor or the softmax scale
    others = {"mscale_all_dim": 1.0, "mscale": 0.707, "original_max_position_embeddings": 1024, "beta_slow": 1.0}
    for field, value in {**others, "beta_fast": 32.0, "factor": 8}.items():
        with pytest.raises(ValueError, match=rope):
            load("yarn", rope_scaling=Yarn(**{**_fields(YARN), field: value}))
    # fields that change nothing the model computes are no reason to refuse: an original context of 16 puts the
    # ramp's bounds on the same pairs; a config.json without the optional fields means transformers' defaults
    load("yarn", rope_scaling=Yarn(**{**_fields(YARN), "original_max_position_embeddings": 16}))
    config = json.loads((tmp_path / "yarn" / "config.json").read_text())
    bare = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
    config |= {"rope_scaling": bare, "rope_parameters": bare}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(config))
    load("yarn", rope_scaling=Yarn(factor=4, original_max_position_embeddings=8))  # beta 32 / 1, mscale 1, no all_dim
    with pytest.raises(ValueError, match=rope):
        load("yarn", rope_scaling=Yarn(factor=4, original_max_position_embeddings=8, mscale_all_dim=1.0))
    with pytest.raises(ValueError, match="kv_lora_rank is 32 in config.json but 16 in the model"):
        load("plain", kv_lora_rank=16)
    with pytest.raises(ValueError, match="n_group is 4 in config.json but 2 in the model"):
        load("plain", n_group=2)
    with pytest.raises(ValueError, match="routed_scaling_factor is 2.5 in config.json but 1.0 in the model"):
        load("plain", routed_scaling_factor=1.0)
    # the published DeepSeek-V3 / Kimi K2 folders: FP8 blocks whose scales an import would drop
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config \(fp8\).*dequantize the folder to bf16 first"):
        load("plain")


def _fields(yarn: Yarn) -> dict:
    return {k: v for k, v in yarn.hf().items() if k != "rope_type"}


# ------------------------------------------------------------------------------------------------ router
def test_sigmoid_router_scores_in_fp32_from_bf16_weights() -> None:
    """Under bf16 mixed precision the gate's weight and input are bf16; its logits are still computed in fp32 (as
    transformers computes DeepSeek-V3's, whose gate it keeps in fp32): a bf16 matmul's rounding moves scores by
    about the selection bias's step and changes some tokens' experts. Qwen3's softmax router keeps HF's dtype."""
    torch.manual_seed(0)
    router = Router(256, 64, 6, True, score_func="sigmoid", route_scale=2.5).to(torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    logits = router.gate(x)
    assert logits.dtype == torch.float32
    want = x.float() @ router.gate.weight.float().T
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits, (x @ router.gate.weight.T).float())  # a bf16 matmul would differ
    _, weights, ids = router(x)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(ids, torch.topk(torch.sigmoid(want), 6, dim=-1).indices)
    softmax = Router(256, 64, 6, True).to(torch.bfloat16)
    assert softmax.gate(x).dtype == torch.bfloat16


def test_pretrain_flavors_are_the_published_shapes_without_rope_scaling() -> None:
    """DeepSeek-V3 and Kimi K2 pretrained on 4K sequences with plain RoPE (YaRN came with the long-context stage):
    the `_pretrain` flavors have the published shapes, no scaling, and head_dim^-0.5 as their softmax scale."""
    for flavor in ("671B", "kimi_k2"):
        full, pre = build_model(flavor), build_model(f"{flavor}_pretrain")
        assert dataclasses.replace(pre.args, rope_scaling=full.args.rope_scaling) == full.args
        assert pre.args.rope_scaling is None and pre.layers["0"].attention.softmax_scale == 192**-0.5
        assert {n: p.shape for n, p in pre.named_parameters()} == {n: p.shape for n, p in full.named_parameters()}


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
@pytest.mark.parametrize("groups", [(4, 2), (1, 1)], ids=["grouped", "ungrouped"])
def test_router_equals_hf_router(norm, groups) -> None:
    n_group, topk_group = groups
    g = torch.Generator().manual_seed(0)
    ours = Router(64, 8, 2, norm, score_func="sigmoid", n_group=n_group, topk_group=topk_group, route_scale=2.5)
    config = transformers.DeepseekV3Config(
        hidden_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
    )
    theirs = hf_ds.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ours.gate.weight.copy_(torch.randn(8, 64, generator=g) * 0.25)  # logits ~ N(0, 4): scores over (0, 1)
        ours.expert_bias.copy_(torch.randn(8, generator=g) * 0.1)
        theirs.weight.copy_(ours.gate.weight)
        theirs.e_score_correction_bias.copy_(ours.expert_bias)
    x = torch.randn(400, 64, generator=g)
    if n_group > 1:
        assert _changed_choices(ours, x, n_group=1) > 0
    assert _changed_choices(ours, x, expert_bias=torch.zeros(8)) > 0
    with torch.no_grad():
        probs, weights, ids = ours(x)
        _, hf_weights, hf_ids = theirs(x)
    ids, order = ids.sort(-1)
    hf_ids, hf_order = hf_ids.sort(-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(-1, order), hf_weights.gather(-1, hf_order), rtol=1e-6, atol=0)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((400,), 2.5))
    torch.testing.assert_close(probs.sum(-1), torch.ones(400))


# ---------------------------------------------------------------------------------------------- generation


def test_latent_kv_cache_equals_the_uncached_forward() -> None:
    """Left-padded prompts of different lengths through the latent cache (each layer keeps kv_lora_rank +
    qk_rope_head_dim per token, not per head): the prefill's and every decode step's logits are each prompt's
    uncached forward's; generate's greedy tokens those of the uncached loop."""
    model = _tiny(rope_scaling=YARN).eval()
    prompts = [[5, 17, 3, 9, 44, 2, 71], [8, 1], [60, 61, 62, 63]]
    longest, steps = 7, 5
    pad = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.zeros(3, longest, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, pad[row] :] = torch.tensor(p)
    cache = KVCache(len(model.layers), pad, longest + steps)
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        logits = model(tokens, cache)
        for row, p in enumerate(prompts):
            torch.testing.assert_close(logits[row, pad[row] :], model(torch.tensor([p]))[0], rtol=0, atol=1e-5)
        layer = cache.layer(1)
        assert layer.k.shape == (3, longest + steps, 1, 32) and layer.v.shape == (3, longest + steps, 1, 8)
        nxt = logits[:, -1].argmax(-1)
        for _ in range(steps):
            for row in range(3):
                seqs[row].append(int(nxt[row]))
            logits = model(nxt[:, None], cache)[:, -1]
            for row in range(3):
                want = model(torch.tensor([seqs[row]]))[0, -1]
                torch.testing.assert_close(logits[row], want, rtol=0, atol=1e-5)
            nxt = logits.argmax(-1)
    assert len({tuple(s[-steps:]) for s in seqs}) == 3  # not one degenerate continuation
    n = 8
    out = generate(model, prompts, Sampling(max_new_tokens=n))
    assert out.tokens == [uncached_greedy(model, p, n) for p in prompts]


def test_generate_py_on_a_deepseek_v3_export_equals_transformers(tmp_path) -> None:
    """scripts/generate.py maps an HF folder of model_type deepseek_v3 to the family's flavor with its shapes (no
    --model.name) and, both prompts in one left-padded batch, generates transformers' greedy tokens."""
    from titan_dmuon.data import build_tokenizer

    tokenizer = build_tokenizer("byte")
    model = _tiny(vocab=tokenizer.vocab_size)
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model), tokenizer=tokenizer)
    prompts, n = ["def f(x):", "import os, sys"], 8
    text = io.StringIO()
    argv = [str(tmp_path), *[a for p in prompts for a in ("--prompt", p)], "--max-new-tokens", str(n), "--ids"]
    with contextlib.redirect_stdout(text):
        assert load_script("generate").main(argv) == 0
    ids = [[int(t) for t in line.split()[1:]] for line in text.getvalue().splitlines() if line.startswith("ids:")]
    hf = _hf(tmp_path)
    want = []
    for p in prompts:
        prompt = tokenizer.encode(p, bos=True, eos=False)
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt) :].tolist()
        want.append(out[: out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out)
    assert ids == want, text.getvalue()
    assert want[0] != want[1] and len(set(want[0])) > 1

    # the mapping picks each flavor from its own config.json (the published ones' included, and the pretraining
    # flavors, of the same shapes but without YaRN)
    from titan_dmuon.components.checkpoint.convert import job_config

    generate_py = load_script("generate")
    for flavor in (
        "tinymodel",
        "debugmodel",
        "moonlight_16b_a3b",
        "671B",
        "kimi_k2",
        "671B_pretrain",
        "kimi_k2_pretrain",
    ):
        big = build_model(flavor, vocab_size=VOCAB if "model" in flavor else None)
        cfg = job_config(None, None, [])
        generate_py.match_hf_config(cfg, SPEC.state_dict_adapter(big).hf_config(), big.args.vocab_size, False)
        assert (cfg.model.name, cfg.model.flavor) == ("deepseek_v3", flavor)


# ------------------------------------------------------------------------------------ train.py from HF
def test_initial_load_from_a_deepseek_v3_folder(tmp_path) -> None:
    """train.py (1 process) with checkpoint.initial_load_path at an exported folder starts from its weights: one
    step at learning rate 0 leaves them as they are, and its checkpoint holds the folder's tensors bitwise (the
    non-zero selection bias included), not the seeded init."""
    from tests.train_runs import read_checkpoint, run_train, tail, tiny_train_argv

    model = _tiny(vocab=258, seed=5)  # the byte tokenizer's vocabulary (train_configs/debug_model.toml)
    export_hf(model.state_dict(), tmp_path / "hf", SPEC.state_dict_adapter(model))
    argv = tiny_train_argv(
        tmp_path / "run",
        *("--model.name", "deepseek_v3", "--checkpoint.initial_load_path", str(tmp_path / "hf")),
        *("--training.steps", "1", "--training.local_batch_size", "2"),
        *("--optimizer.muon.lr", "0", "--optimizer.adamw.lr", "0"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", "1"),
    )
    proc = run_train(1, argv, timeout=240)
    assert proc.returncode == 0, tail(proc)
    saved = read_checkpoint(tmp_path / "run" / "checkpoint" / "step-1")
    sd = model.state_dict()
    assert {k for k in saved if k.startswith("model.")} == {f"model.{k}" for k in sd}
    for k, t in sd.items():
        assert torch.equal(saved[f"model.{k}"], t), k
    assert saved["model.layers.1.feed_forward.router.expert_bias"].any()
