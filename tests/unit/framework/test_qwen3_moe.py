"""Qwen3-MoE (titan_dmuon/models/common/moe.py and the MoE parts of the qwen3 family) against `transformers`'
Qwen3MoeForCausalLM: logits on our exported weights (fp32, one dense layer via mlp_only_layers), export -> import
bitwise, transformers' own save read back; the router against HF's; the grouped experts' loop against a per-token
reference (an expert with no row, no row at all, grads), and torch._grouped_mm against the loop in bf16; the
auxiliary loss's value (HF's load_balancing_loss_func on one layer) and its gradient (CE + coef * aux computed
directly, also under reentrant checkpointing; aux_loss_scale); the aux-free bias; moe_stats / update_moe_bias; the
flavors, parameter counts and FLOPs; the 3-D init; scripts/generate.py on an MoE folder; and on 2 gloo ranks
(slow) the TP plan against one process and load_hf_weights reading only a rank's experts."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import re

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from tests._scripts import load_script
from titan_dmuon.components.checkpoint.hf_io import export_hf, load_hf_weights
from titan_dmuon.components.initialization import fill_, full_index, trunc_normal
from titan_dmuon.components.model import get_model_spec
from titan_dmuon.components.moe import MoELayer, moe_layers, moe_stats, update_moe_bias
from titan_dmuon.models.common.moe import MoE, experts_grouped_mm, experts_loop
from titan_dmuon.models.qwen3 import SPEC, build_model, head_blocks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe  # noqa: E402

VOCAB, SEQ = 97, 32


def _tiny(vocab: int = VOCAB, **overrides) -> torch.nn.Module:
    """tinymodel_moe with 4 experts, layer 1 dense (both kinds of feed-forward), untied, peaked attention and a
    router sharp enough that the top-k choice matters."""
    torch.manual_seed(0)
    args = dict(num_experts=4, mlp_only_layers=(1,), tie_embeddings=False) | overrides
    model = build_model("tinymodel_moe", vocab_size=vocab, device="cpu", max_seq_len=SEQ, **args)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.k_norm.weight.uniform_(0.5, 1.5)
        for moe in moe_layers(model):
            moe.router.gate.weight.mul_(20)
            moe.experts.w2.mul_(10)  # depth-scaled init: make the experts' share of the logits visible
    return model


def _tokens(seed: int = 1, batch: int = 2, vocab: int = VOCAB, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf(folder) -> torch.nn.Module:
    return transformers.Qwen3MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------- flavors and counts
def test_flavors_blocks_and_muon_params() -> None:
    assert get_model_spec("qwen3") is SPEC
    assert {"debugmodel_moe", "tinymodel_moe", "30B-A3B", "235B-A22B"} <= set(SPEC.flavors)
    model = SPEC.build("tinymodel_moe", vocab_size=64, max_seq_len=16, mlp_only_layers=(1,))  # meta
    assert [type(b.feed_forward) for b in model.layers.values()] == [MoE, type(model.layers["1"].feed_forward)]
    # the MoE protocol finds exactly the sparse layer, and its expert stacks are the 3-D params Muon takes
    assert moe_layers(model) == [model.layers["0"].feed_forward] and isinstance(moe_layers(model)[0], MoELayer)
    assert list(moe_layers(model)[0].expert_params()) == ["w1", "w2", "w3"]
    assert [fqn for fqn, _ in SPEC.blocks(model)] == ["layers.0", "layers.1"]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.0.feed_forward")}
    assert shapes == {
        "layers.0.feed_forward.router.gate.weight": (8, 64),
        "layers.0.feed_forward.experts.w1": (8, 32, 64),
        "layers.0.feed_forward.experts.w2": (8, 64, 32),
        "layers.0.feed_forward.experts.w3": (8, 32, 64),
    }
    muon = {n for n, _ in model.named_parameters() if re.search(SPEC.muon_params, n)}
    assert {f"layers.0.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")} <= muon
    assert {f"layers.1.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")} <= muon
    assert not [n for n in muon if "router" in n or "norm" in n or "embed" in n]
    assert len(muon) == 2 * 4 + 3 + 3  # attention x 2, the experts' stacks, the dense layer's SwiGLU
    assert set(head_blocks(model)) == {
        f"layers.{i}.attention.{w}.weight" for i in (0, 1) for w in ("wq wk wv wo".split())
    }
    buffers = {n for n, _ in model.named_buffers()}
    assert "layers.0.feed_forward.router.expert_bias" in model.state_dict()
    assert "layers.0.feed_forward.tokens_per_expert" in buffers
    assert "layers.0.feed_forward.tokens_per_expert" not in model.state_dict()


@pytest.mark.parametrize(
    "flavor, total, active",
    [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)],
)
def test_published_sizes_on_meta(flavor, total, active) -> None:
    model = build_model(flavor)
    a = model.args
    assert (a.vocab_size, a.head_dim, a.n_kv_heads, a.num_experts, a.top_k, a.tie_embeddings) == (
        151936,
        128,
        4,
        128,
        8,
        False,
    )
    assert a.norm_topk_prob and a.n_moe_layers == a.n_layers
    assert abs(model.num_params() / total - 1) < 0.02, model.num_params()
    assert abs(model.num_active_params() / active - 1) < 0.03, model.num_active_params()


def test_param_count_and_flops_count_active_experts() -> None:
    model = build_model("debugmodel_moe", vocab_size=512)
    a = model.args
    attention = 256 * 512 + 2 * 256 * 256 + 512 * 256 + 2 * 256 + 2 * 64
    experts = 8 * 3 * 256 * 128
    assert model.num_params() == 512 * 256 + 4 * (attention + 8 * 256 + experts) + 256  # tied, + final norm
    assert model.num_active_params() == model.num_params() - 4 * experts * 6 // 8
    matmul = model.num_params(exclude_embedding=True) + 512 * 256 - 4 * experts * 6 // 8  # tied head, 2 of 8
    assert model.num_flops_per_token(16) == 6 * matmul + 12 * a.n_layers * 8 * 64 * 16
    assert SPEC.nparams_and_flops(model, 16) == (model.num_params(), model.num_flops_per_token(16))


def test_tinymodel_moe_trains_4_steps_quickly() -> None:
    """4 AdamW steps with aux-free balancing: the loss falls, each step's counts move the biases by rate * sign."""
    torch.manual_seed(0)
    model = build_model("tinymodel_moe", vocab_size=VOCAB, device="cpu", max_seq_len=SEQ, bias_update_rate=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = _tokens(3, batch=4)
    losses, moved = [], torch.zeros(2, 8)
    for _ in range(4):
        loss = SPEC.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        counts = moe_stats(model)["tokens_per_expert"]
        assert counts.sum(1).tolist() == [4 * (SEQ - 1) * 2] * 2
        update_moe_bias(model, counts)
        moved += 1e-3 * torch.sign(counts.float().mean(1, keepdim=True) - counts)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    torch.testing.assert_close(torch.stack([m.router.expert_bias for m in moe_layers(model)]), moved)
    assert moved.abs().max() > 0


# --------------------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_transformers_logits_and_bitwise_import(tmp_path, norm) -> None:
    model = _tiny(norm_topk_prob=norm)
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    export_hf(sd, tmp_path / "one", adapter)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 32)
    assert config["mlp_only_layers"] == [1] and config["norm_topk_prob"] is norm
    hf = _hf(tmp_path / "one")
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    tokens = _tokens()
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # the published per-expert layout; a zero selection bias is left out (what a folder without one means)
    files = export_hf(sd, tmp_path / "sharded", adapter, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and "model.layers.0.mlp.experts.3.down_proj.weight" in index
    assert "model.layers.0.mlp.gate.weight" in index and not [n for n in index if "bias" in n]
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "sharded", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k
    hf.save_pretrained(str(tmp_path / "resaved"))  # transformers' own save (its fused experts, unfused on disk)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    load_hf_weights(back, tmp_path / "resaved", adapter)
    for k, t in sd.items():
        assert torch.equal(back[k], t), k


def test_a_moved_selection_bias_round_trips(tmp_path) -> None:
    model = _tiny()
    with torch.no_grad():
        model.layers["0"].feed_forward.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
    adapter = SPEC.state_dict_adapter(model)
    sd = model.state_dict()
    export_hf(sd, tmp_path, adapter)
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    load_hf_weights(back, tmp_path, adapter)
    assert all(torch.equal(back[k], t) for k, t in sd.items())
    hf_sd = adapter.to_hf_state_dict(sd)
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in hf_sd
    assert all(torch.equal(adapter.from_hf_state_dict(hf_sd)[k], t) for k, t in sd.items())


def test_router_equals_hf_router() -> None:
    for norm in (True, False):
        model = _tiny(norm_topk_prob=norm)
        router = model.layers["0"].feed_forward.router
        config = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm)
        theirs = hf_moe.Qwen3MoeTopKRouter(config)
        with torch.no_grad():
            theirs.weight.copy_(router.gate.weight)
        x = torch.randn(50, 64)
        probs, weights, ids = router(x)
        _, hf_weights, hf_ids = theirs(x)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        torch.testing.assert_close(probs.sum(-1), torch.ones(50))


# ----------------------------------------------------------------------------------------- grouped experts
def _naive_experts(x, ids, w1, w2, w3):
    """Each row through its own expert, one row at a time."""
    return torch.stack([w2[e] @ (F.silu(w1[e] @ row) * (w3[e] @ row)) for row, e in zip(x, ids.tolist(), strict=True)])


def _expert_weights(e=4, h=8, d=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in ((e, h, d), (e, d, h), (e, h, d))]


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [0, 4, 0, 0]], ids=["one_empty", "none", "one_busy"])
def test_experts_loop_equals_per_row_reference(counts) -> None:
    w1, w2, w3 = _expert_weights()
    n = sum(counts)
    x = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    counts_t = torch.tensor(counts, dtype=torch.int64)
    out = experts_loop(x, counts_t, w1, w2, w3)
    assert out.shape == (n, 16) and out.requires_grad
    grad = torch.randn(n, 16, dtype=torch.float64)
    got = torch.autograd.grad(out, [x, w1, w2, w3], grad)
    assert all(g is not None for g in got)  # the weights stay in the graph even with no row
    if n:
        want_out = _naive_experts(x, ids, w1, w2, w3)
        torch.testing.assert_close(out, want_out)
        want = torch.autograd.grad(want_out, [x, w1, w2, w3], grad)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    else:
        assert all(not g.any() for g in got)


def test_grouped_mm_equals_the_loop_in_bf16() -> None:
    w1, w2, w3 = (w.detach().to(torch.bfloat16).requires_grad_() for w in _expert_weights(h=16, d=32))
    counts = torch.tensor([3, 0, 5, 8])
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    try:
        fast = experts_grouped_mm(x, counts, w1, w2, w3)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run here in bf16: {e}")
    slow = experts_loop(x, counts, w1, w2, w3)
    torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
    grad = torch.randn(16, 32, dtype=torch.bfloat16)
    fast_grads = torch.autograd.grad(fast, [x, w1, w2, w3], grad)
    for a, b in zip(fast_grads, torch.autograd.grad(slow, [x, w1, w2, w3], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-2)
    assert all(not g[1].any() for g in fast_grads[1:])  # expert 1 has no row: its weight grads are exactly zero


def test_grouped_path_zeroes_what_a_kernel_leaves_in_empty_groups() -> None:
    """Whatever a grouped-GEMM kernel writes into a zero-size group's weight grad (NaN here) is zeroed."""
    from titan_dmuon.models.common.moe import _ZeroEmptyGroups

    w = torch.randn(3, 4, 5, requires_grad=True)
    counts = torch.tensor([2, 0, 1])
    poison = torch.ones(3, 4, 5)
    poison[1] = float("nan")
    (_ZeroEmptyGroups.apply(w, counts) * poison).sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(4, 5)) and torch.equal(w.grad[[0, 2]], torch.ones(2, 4, 5))


# ---------------------------------------------------------------------------------------------- aux loss
def _moe(coef: float = 0.1, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2, aux_loss_coef=coef, **kw).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def _aux_direct(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e P_e from the router's own logits, written out."""
    probs = torch.softmax(moe.router.gate(x.reshape(-1, x.shape[-1])).float(), dim=-1)
    ids = torch.topk(probs, moe.top_k, dim=-1).indices
    f = F.one_hot(ids, moe.num_experts).sum((0, 1)).float() / probs.shape[0]
    return moe.num_experts * (f * probs.mean(0)).sum()


def test_aux_loss_value_matches_hf_formula() -> None:
    moe = _moe()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    probs, _, ids = moe.router(x.view(-1, 16))
    aux, value = moe._aux_loss(probs, ids.flatten().bincount(minlength=4))
    logits = moe.router.gate(x.view(-1, 16))
    want = hf_moe.load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(aux.double(), want.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(value.double(), want.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(_aux_direct(moe, x).double(), want.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant_checkpoint"])
def test_aux_loss_gradient_reaches_the_router(scale, reentrant) -> None:
    """The grads of sum(out * g) through our MoE (aux injected) equal those of sum(out * g) + coef * scale * aux
    computed directly on a copy without injection."""
    coef = 0.1
    moe = _moe(coef)
    moe.aux_loss_scale = scale
    ref = copy.deepcopy(moe)
    ref.aux_loss_coef = 0.0
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 10, 16, dtype=torch.float64)
    out = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=True) if reentrant else moe(x)
    (out * g).sum().backward()  # (reentrant checkpointing supports .backward() only)
    got = [x.grad, moe.router.gate.weight.grad, moe.experts.w1.grad]
    x.grad = None
    loss = (ref(x) * g).sum() + coef * scale * _aux_direct(ref, x)
    want = torch.autograd.grad(loss, [x, ref.router.gate.weight, ref.experts.w1])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    without = torch.autograd.grad((ref(x) * g).sum(), ref.router.gate.weight)[0]
    assert (got[1] - without).abs().max() > 1e-4  # the aux term is visible


def test_aux_loss_in_the_model_under_reentrant_checkpointing() -> None:
    """CE + coef * mean over MoE layers of aux: every grad of a model whose blocks run under reentrant
    checkpointing equals that of the loss written out (routers' probabilities read by hooks on a copy)."""
    model = _tiny(mlp_only_layers=(), aux_loss_coef=0.05)
    ref = copy.deepcopy(model)
    for moe in moe_layers(ref):
        moe.aux_loss_coef = 0.0
    seen = []
    for moe in moe_layers(ref):
        moe.register_forward_pre_hook(lambda m, args: seen.append(_aux_direct(m, args[0])))
    for block in model.layers.values():
        fwd = block.forward
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, fwd, use_reentrant=True)
    tokens = _tokens(4)
    SPEC.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    loss = SPEC.loss_fn(ref(tokens[:, :-1]), tokens[:, 1:]) + 0.05 * torch.stack(seen).mean()
    loss.backward()
    assert len(seen) == 2
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refs[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    # the recompute in backward counted nothing twice
    assert moe_stats(model)["tokens_per_expert"].sum(1).tolist() == [2 * (SEQ - 1) * 2] * 2


# -------------------------------------------------------------------------------------- aux-free balancing
def test_selection_bias_changes_the_choice_not_the_weights() -> None:
    moe = _moe(bias_update_rate=0.01)
    x = torch.randn(40, 16, dtype=torch.float64)
    probs, weights, ids = moe.router(x)
    with torch.no_grad():
        moe.router.expert_bias[3] = 10.0
    probs2, weights2, ids2 = moe.router(x)
    assert torch.equal(probs, probs2) and (ids2 == 3).any(1).all() and not torch.equal(ids, ids2)
    top = probs2.gather(-1, ids2)
    torch.testing.assert_close(weights2, (top / top.sum(-1, keepdim=True)).to(weights2.dtype))

    moe.router.expert_bias.zero_()
    moe.update_bias(torch.tensor([10, 2, 4, 0]))  # mean 4: below it up, above it down, at it unchanged
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    off = _moe()
    off.update_bias(torch.tensor([10, 2, 4, 0]))
    assert not off.router.expert_bias.any()


# ------------------------------------------------------------------------------------------------ metrics
def test_moe_stats_count_and_reset() -> None:
    model = _tiny(mlp_only_layers=())
    tokens = _tokens(5)
    values = []
    for layer in moe_layers(model):
        layer.register_forward_hook(lambda m, a, o: values.append(_aux_direct(m, a[0]).detach()))
    model(tokens)
    model(tokens[:1])
    stats = moe_stats(model)
    assert stats["tokens_per_expert"].dtype == torch.int64 and stats["tokens_per_expert"].shape == (2, 4)
    assert stats["tokens_per_expert"].sum(1).tolist() == [3 * SEQ * 2] * 2
    torch.testing.assert_close(stats["aux_loss"], torch.stack(values).mean().float())
    again = moe_stats(model)
    assert not again["tokens_per_expert"].any() and again["aux_loss"] == 0
    with torch.no_grad():
        model.eval()(tokens)  # evaluation is not counted
    assert not moe_stats(model)["tokens_per_expert"].any()
    update_moe_bias(model, stats["tokens_per_expert"])  # rate 0: no-op
    assert not any(m.router.expert_bias.any() for m in moe_layers(model))
    dense = build_model("tinymodel", vocab_size=VOCAB)
    assert moe_stats(dense)["tokens_per_expert"].shape == (0, 0)
    update_moe_bias(dense, torch.zeros(0, 0))


# --------------------------------------------------------------------------------------------------- init
def test_init_of_a_3d_param_is_a_function_of_the_fqn_and_position() -> None:
    """The experts' stacks: any dim-0 slice (an EP shard), or block of rows, draws the full tensor's values."""
    shape, init = (6, 700, 40), trunc_normal(0.02)
    full = fill_(torch.empty(shape), init, 7, "layers.0.feed_forward.experts.w1", shape, full_index(shape))
    assert 0.015 < full.std() < 0.025 and not torch.equal(full[0], full[1])
    index = [torch.arange(2, 5), torch.arange(100, 650), torch.arange(10, 40)]
    part = fill_(torch.empty(3, 550, 30), init, 7, "layers.0.feed_forward.experts.w1", shape, index)
    assert torch.equal(part, full[2:5, 100:650, 10:40])
    model = build_model("tinymodel_moe", vocab_size=VOCAB)
    inits = SPEC.param_inits(model)
    assert inits["layers.0.feed_forward.experts.w1"] == trunc_normal(0.02)
    assert inits["layers.1.feed_forward.experts.w2"] == inits["layers.1.attention.wo.weight"]
    assert inits["layers.1.feed_forward.experts.w3"] == inits["layers.1.attention.wo.weight"]
    assert inits["layers.0.feed_forward.router.gate.weight"] == trunc_normal(0.02)


# ---------------------------------------------------------------------------------------------- generation
def test_generate_py_on_a_moe_export(tmp_path) -> None:
    """scripts/generate.py maps an HF folder of model_type qwen3_moe to the qwen3 family's MoE flavor with its
    shapes and generates what the model does."""
    from titan_dmuon.data import build_tokenizer

    tokenizer = build_tokenizer("byte")
    torch.manual_seed(0)
    model = build_model("tinymodel_moe", vocab_size=tokenizer.vocab_size, device="cpu", max_seq_len=SEQ)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(10)
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model), tokenizer=tokenizer)
    text = io.StringIO()
    argv = [str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "6", "--ids"]
    with contextlib.redirect_stdout(text):
        assert load_script("generate").main(argv) == 0
    ids = [[int(t) for t in line.split()[1:]] for line in text.getvalue().splitlines() if line.startswith("ids:")]
    seq = tokenizer.encode("def f(x):", bos=True, eos=False)
    want = []
    with torch.no_grad():
        for _ in range(6):
            want.append(int(model.eval()(torch.tensor([seq + want]))[0, -1].argmax()))
    if tokenizer.eos_id in want:
        want = want[: want.index(tokenizer.eos_id)]
    assert ids == [want], text.getvalue()


# ------------------------------------------------------------------------------------- 2 gloo ranks (slow)
def _two_ranks(rank: int, world: int, folder: str) -> dict:
    import safetensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_dmuon.components.initialization import global_index

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    # (1) an expert-parallel shard: the rank reads only its experts' tensors
    ref = _tiny(mlp_only_layers=())
    adapter = SPEC.state_dict_adapter(ref)
    fqn = "layers.0.feed_forward.experts.w2"
    template = {fqn: distribute_tensor(torch.zeros(4, 64, 32), mesh, [Shard(0)])}
    read, real_open = [], safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, name):
            read.append(name)
            return self.f.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

        def keys(self):
            return self.f.keys()

    safetensors.safe_open = Spy
    try:
        load_hf_weights(template, folder, adapter)
    finally:
        safetensors.safe_open = real_open
    local = template[fqn].to_local()
    out["ep_local"] = bool(torch.equal(local, ref.state_dict()[fqn][2 * rank : 2 * rank + 2]))
    # ... and the init of such a shard draws the full tensor's values of its experts
    init, shape = trunc_normal(0.02), (4, 600, 32)
    shard = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
    fill_(shard.to_local(), init, 3, fqn, shape, global_index(shard))
    full = fill_(torch.empty(shape), init, 3, fqn, shape, full_index(shape))
    out["init"] = bool(torch.equal(shard.to_local(), full[2 * rank : 2 * rank + 2]))
    out["ep_read"] = sorted({int(re.search(r"experts\.(\d+)\.", n).group(1)) for n in read if "experts." in n})

    # (2) TP 2 with sequence parallelism against one process: loss, grads, the aux loss and the counts
    model = _tiny(mlp_only_layers=(), aux_loss_coef=0.05)
    ref = copy.deepcopy(model)
    SPEC.apply_tp(model, mesh)
    tokens = _tokens(6, length=SEQ + 1)  # inputs of SEQ tokens: the sequence splits evenly over the TP ranks
    with loss_parallel():
        loss = SPEC.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    want = SPEC.loss_fn(ref(tokens[:, :-1]), tokens[:, 1:])
    want.backward()
    out["loss"] = (loss.item(), want.item())
    refs, worst = dict(ref.named_parameters()), {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if ".experts." in name:  # whole on every TP rank, each with its own tokens' grad: the sum is the grad
            g = g.clone()
            torch.distributed.all_reduce(g, group=mesh.get_group())
        worst[name] = float((g - refs[name].grad).abs().max() / refs[name].grad.abs().max())
    out["grads"] = worst
    out["router_placements"] = str(model.layers["0"].feed_forward.router.gate.weight.placements)
    stats, want_stats = moe_stats(model), moe_stats(ref)
    out["aux"] = (stats["aux_loss"].item(), want_stats["aux_loss"].item())
    counts = stats["tokens_per_expert"].clone()
    torch.distributed.all_reduce(counts, group=mesh.get_group())
    out["counts"] = bool(torch.equal(counts, want_stats["tokens_per_expert"]))
    return out


@pytest.mark.slow
def test_tp_plan_and_expert_sharded_load_on_2_ranks(tmp_path) -> None:
    model = _tiny(mlp_only_layers=())
    export_hf(model.state_dict(), tmp_path, SPEC.state_dict_adapter(model), max_shard_bytes=30_000)
    for rank, out in enumerate(run_distributed(functools.partial(_two_ranks, folder=str(tmp_path)), 2, timeout=240)):
        assert out["ep_local"] and out["ep_read"] == [2 * rank, 2 * rank + 1] and out["init"]
        tp_loss, loss = out["loss"]
        assert abs(tp_loss - loss) <= 1e-5 * loss
        assert out["router_placements"] == "(Replicate(),)"
        bad = {n: w for n, w in out["grads"].items() if w > 1e-4}
        assert not bad, bad
        aux, want = out["aux"]
        assert abs(aux - want) <= 1e-5 * want and out["counts"]
