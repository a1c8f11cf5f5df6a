"""QK-clip (titan_dmuon/dmuon/qk_clip.py, its module docstring is the spec) and how the attention layers report to
it (titan_dmuon/models/common/attention.py, and MLA's titan_dmuon/models/common/mla.py), single process, no process
group.

Every expected value is computed here, independently of qk_clip.py: the q and k that attention really uses are
intercepted at `F.scaled_dot_product_attention` ([B, H, L, D], k already repeated for GQA) and their causal
q·kᵀ/√D is taken per head in fp64."""

from __future__ import annotations

import contextlib
import functools
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from titan_dmuon import dmuon
from titan_dmuon.dmuon.qk_clip import QKClip, max_logit_per_head
from titan_dmuon.models import deepseek_v3, llama3, qwen3
from titan_dmuon.models.common.attention import Attention

VOCAB, SEQ, B, L = 128, 32, 4, 24


# ----------------------------------------------------------------------------------------------------------- helpers
def causal_max(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """[H] fp64: the largest causal logit q·k·scale (default 1/sqrt(D)) of each head; q, k [B, H, L, D] (k one per
    query head)."""
    q64, k64 = q.detach().double(), k.detach().double()
    logits = q64 @ k64.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    n = q.shape[2]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return logits.masked_fill(future, -math.inf).amax(dim=(0, 2, 3))


@contextlib.contextmanager
def sdpa_max_logits():
    """A list that gets, for each SDPA call inside the block, the [H] fp64 causal max logit of its q and k."""
    seen: list[torch.Tensor] = []
    real = F.scaled_dot_product_attention

    def wrapper(q, k, v, *args, **kwargs):
        assert kwargs.get("is_causal") and kwargs.get("attn_mask") is None  # training: the plain causal path
        seen.append(causal_max(q, k, kwargs.get("scale")))  # MLA passes its softmax scale
        return real(q, k, v, *args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", wrapper):
        yield seen


def build(family, flavor: str, seed: int = 0, qk_scale: float = 1.0):
    """A materialized model; `qk_scale` multiplies every wq and wk (init logits are ~1e-2: this makes them O(1))."""
    torch.manual_seed(seed)
    model = family.build_model(flavor, vocab_size=VOCAB, max_seq_len=SEQ, device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    if qk_scale != 1.0:
        with torch.no_grad():
            for attn in attentions(model):
                attn.wq.weight.mul_(qk_scale)
                attn.wk.weight.mul_(qk_scale)
    return model


def attentions(model) -> list[Attention]:
    return [block.attention for block in model.layers.values()]


def tokens(seed: int, batch: int = B, length: int = L) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def measured(model, toks: torch.Tensor) -> torch.Tensor:
    """[layers, H] fp64: the intercepted per-head max logits of one forward (one SDPA call per layer, in order)."""
    with torch.no_grad(), sdpa_max_logits() as seen:
        model(toks)
    assert len(seen) == len(model.layers)
    return torch.stack(seen)


def attention_inputs(model, toks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's (x, rope) in a forward on `toks` (no grad: nothing is measured)."""
    inputs = []
    handles = [
        a.register_forward_pre_hook(lambda _m, args: inputs.append(tuple(t.detach().clone() for t in args)))
        for a in attentions(model)
    ]
    try:
        with torch.no_grad():
            model(toks)
    finally:
        for h in handles:
            h.remove()
    return inputs


def rerun(model, inputs) -> torch.Tensor:
    """[layers, H] fp64: each attention layer run again on its recorded input (so a clip of an earlier layer does
    not move a later layer's input), logits intercepted."""
    out = []
    for attn, args in zip(attentions(model), inputs, strict=True):
        with torch.no_grad(), sdpa_max_logits() as seen:
            attn(*args)
        out.append(seen[0])
    return torch.stack(out)


def qk_weights(model) -> list[dict[str, torch.Tensor]]:
    return [{n: p.detach().clone() for n, p in a.named_parameters()} for a in attentions(model)]


def clip_step(model, tau: float, toks: torch.Tensor) -> QKClip:
    """Build the clip, one training forward, then launch / wait / scale."""
    clip = QKClip(model, tau, device="cpu")
    model(toks)
    clip.launch()
    clip.wait()
    clip.scale_params_()
    return clip


def tau_between(s: torch.Tensor) -> float:
    """A tau strictly between the heads' max logits (about half over it), far from any of them."""
    v = s.flatten().sort().values
    i = len(v) // 2
    return float((v[i - 1] + v[i]) / 2)


# ----------------------------------------------------------------------------------------------- 1. max_logit_per_head
@pytest.mark.parametrize("chunk_elements", [1 << 24, 300, 1])
def test_max_logit_per_head_matches_direct_causal_max(chunk_elements):
    # catches a wrong GQA head mapping (kv head g serves query heads g*r..g*r+r-1), a missed last partial chunk,
    # a wrong chunk offset in the causal mask, or a scale other than 1/sqrt(D)
    g = torch.Generator().manual_seed(1)
    b, n, h, kv, d = 2, 13, 4, 2, 8  # 300 elements: chunks of 2 queries over 13 positions (the last one alone)
    q = torch.randn(b, n, h, d, generator=g)
    k = torch.randn(b, n, kv, d, generator=g)
    expected = causal_max(q.transpose(1, 2), k.repeat_interleave(h // kv, dim=2).transpose(1, 2))
    got = max_logit_per_head(q, k, chunk_elements=chunk_elements)
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 300, 1])
def test_max_logit_per_head_ignores_future_keys(chunk_elements):
    # catches a non-causal max, or a mask that is off by one (drops the diagonal or lets the next key in)
    g = torch.Generator().manual_seed(2)
    b, n, h, kv, d = 2, 13, 4, 2, 8
    q = torch.randn(b, n, h, d, generator=g)
    k = torch.randn(b, n, kv, d, generator=g)
    p = 7
    q[:, p:] = 0.0  # the queries that may see key p give 0 logits
    k[:, p] = 1e4 * q[:, p - 1, :: h // kv]  # key p: huge against query p - 1, which must not see it
    expected = causal_max(q.transpose(1, 2), k.repeat_interleave(h // kv, dim=2).transpose(1, 2))
    got = max_logit_per_head(q, k, chunk_elements=chunk_elements)
    assert got.max() < 100.0
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    # the diagonal is seen: query p of head 1 (kv head 0) against key p gives the largest logit of its head
    k[:, p] = 0.0
    k[:, p, 0] = 10.0
    q[:, p, 1] = 1.0
    got = max_logit_per_head(q, k, chunk_elements=chunk_elements)
    assert got[1].item() == pytest.approx(10.0 * d / math.sqrt(d), rel=1e-6)
    expected = causal_max(q.transpose(1, 2), k.repeat_interleave(h // kv, dim=2).transpose(1, 2))
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ 2. measuring a step
def test_launch_reads_the_training_forward_and_resets():
    # catches a wrong head/layer row in the grid, S not reset after launch, or validation forwards counted
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    clip = QKClip(model, math.inf, device="cpu")
    toks = tokens(0)
    with sdpa_max_logits() as seen:
        model(toks)  # training forward: under grad
    expected = torch.stack(seen)  # [layers, H]
    clip.launch()
    clip.wait()
    assert clip.layer_names == ["layers.0.attention", "layers.1.attention"]
    torch.testing.assert_close(clip.last_max_logits.double(), expected.amax(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close(clip.grid.double(), expected, rtol=1e-5, atol=0)
    for attn in attentions(model):
        assert torch.equal(attn.max_logit, torch.full((4,), -math.inf))
    # validation (no grad) measures nothing
    with torch.no_grad():
        model(tokens(1))
    for attn in attentions(model):
        assert torch.equal(attn.max_logit, torch.full((4,), -math.inf))
    clip.launch()
    clip.wait()
    assert torch.equal(clip.last_max_logits, torch.full((2,), -math.inf))


# --------------------------------------------------------------------------------------------------- 3. the clip rules
def test_clip_multi_head_scales_q_and_k_rows_by_sqrt_gamma():
    # catches gamma (not its sqrt) on both q and k (logits would land at tau^2/S), the wrong rows, or scaled heads
    # that were within tau
    model = build(llama3, "tinymodel", qk_scale=10.0)
    toks = tokens(0)
    inputs = attention_inputs(model, toks)
    s = rerun(model, inputs)
    tau = tau_between(s)
    before = qk_weights(model)
    clip_step(model, tau, toks)
    after = rerun(model, inputs)
    d = 16
    clipped = s > tau
    assert clipped.any() and (~clipped).any()
    for layer, attn in enumerate(attentions(model)):
        for h in range(4):
            rows = slice(h * d, (h + 1) * d)
            for name in ("wq.weight", "wk.weight"):
                new, old = attn.get_parameter(name)[rows].detach(), before[layer][name][rows]
                if clipped[layer, h]:
                    factor = math.sqrt(tau / float(s[layer, h]))
                    torch.testing.assert_close(new, old * factor, rtol=1e-5, atol=0)
                else:
                    assert torch.equal(new, old)
            if clipped[layer, h]:
                assert after[layer, h].item() == pytest.approx(tau, rel=1e-5)
            else:
                assert after[layer, h].item() == pytest.approx(s[layer, h].item(), rel=1e-6)
        assert torch.equal(attn.wv.weight, before[layer]["wv.weight"])


def test_clip_gqa_scales_only_the_query_rows_by_gamma():
    # catches the shared key head scaled under GQA (its other query heads would be clipped too), or sqrt(gamma) on q
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    toks = tokens(0)
    inputs = attention_inputs(model, toks)
    s = rerun(model, inputs)
    tau = tau_between(s)
    before = qk_weights(model)
    clip_step(model, tau, toks)
    after = rerun(model, inputs)
    d = 16
    clipped = s > tau
    assert clipped.any() and (~clipped).any()
    # some kv head serves a clipped and an unclipped query head: scaling the shared key would show
    assert (clipped.view(2, 2, 2).any(-1) & (~clipped).view(2, 2, 2).any(-1)).any()
    for layer, attn in enumerate(attentions(model)):
        assert torch.equal(attn.wk.weight, before[layer]["wk.weight"])
        for h in range(4):
            rows = slice(h * d, (h + 1) * d)
            new, old = attn.wq.weight[rows].detach(), before[layer]["wq.weight"][rows]
            if clipped[layer, h]:
                torch.testing.assert_close(new, old * (tau / float(s[layer, h])), rtol=1e-5, atol=0)
                assert after[layer, h].item() == pytest.approx(tau, rel=1e-5)
            else:
                assert torch.equal(new, old)
                assert after[layer, h].item() == pytest.approx(s[layer, h].item(), rel=1e-6)


def test_clip_qk_norm_scales_the_query_gain_by_the_layers_smallest_gamma():
    # catches the projections scaled under a QK-norm (no effect: the norm removes it), the key gain scaled under
    # GQA, or a gamma other than the layer's smallest (its worst head would stay over tau)
    model = build(qwen3, "tinymodel")
    toks = tokens(0)
    inputs = attention_inputs(model, toks)
    s = rerun(model, inputs)
    worst = s.amax(dim=1)
    assert worst[0] != worst[1]
    tau = float(worst.mean())  # the layer with the larger worst head is clipped, the other is not
    hot = int(worst.argmax())
    before = qk_weights(model)
    clip = clip_step(model, tau, toks)
    after = rerun(model, inputs)
    assert clip.layers[hot].heads.shared_gain
    for layer, attn in enumerate(attentions(model)):
        for name in ("wq.weight", "wk.weight", "k_norm.weight"):
            assert torch.equal(attn.get_parameter(name), before[layer][name]), name
        if layer == hot:
            gamma = tau / float(worst[layer])
            torch.testing.assert_close(
                attn.q_norm.weight.detach(), before[layer]["q_norm.weight"] * gamma, rtol=1e-5, atol=0
            )
            assert after[layer].max().item() == pytest.approx(tau, rel=1e-5)
            assert (after[layer] <= tau * (1 + 1e-5)).all()
            torch.testing.assert_close(after[layer], s[layer] * gamma, rtol=1e-5, atol=0)
        else:
            assert torch.equal(attn.q_norm.weight, before[layer]["q_norm.weight"])
            torch.testing.assert_close(after[layer], s[layer], rtol=1e-6, atol=0)


def build_mla(q_lora_rank: int, seed: int = 0):
    """deepseek_v3 tinymodel (MLA; `q_lora_rank` 0: a full-rank wq), its query and key/value projections scaled up so
    that both parts of a logit, the non-rotary (q_nope·k_nope) and the rotary (q_rope against the shared key from
    wkv_a's last rows), are O(1) at init."""
    torch.manual_seed(seed)
    model = deepseek_v3.build_model(
        "tinymodel", vocab_size=VOCAB, max_seq_len=SEQ, device="cpu", q_lora_rank=q_lora_rank
    )
    model.init_buffers("cpu")
    with torch.no_grad():
        for attn in attentions(model):
            for name, scale in (("wq", 10.0), ("wq_b", 10.0), ("wkv_a", 4.0), ("wkv_b", 10.0)):
                if getattr(attn, name) is not None:
                    getattr(attn, name).weight.mul_(scale)
    return model


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["q_lora", "no_q_lora"])
def test_clip_mla_rotary_query_rows_by_gamma_the_rest_by_sqrt_gamma_shared_key_and_values_untouched(q_lora_rank):
    # catches sqrt(gamma) on the rotary query rows (the head would land above tau: its rotary part keeps sqrt(gamma)
    # of itself), the shared rotary key (wkv_a) or the value rows of wkv_b scaled, runs laid out off by a head's
    # offset, or scaled heads that were within tau
    model = build_mla(q_lora_rank)
    a = model.args
    nope, rope, vdim, heads = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.n_heads
    toks = tokens(0)
    inputs = attention_inputs(model, toks)
    s = rerun(model, inputs)
    # both parts of the logit count: the rotary part alone (queries' non-rotary rows at 0) is far from 0 and from S
    zeroed = []
    for attn in attentions(model):
        q = attn.get_parameter(f"{attn.q_proj}.weight")
        zeroed.append(q.detach().clone())
        with torch.no_grad():
            q.view(heads, nope + rope, -1)[:, :nope] = 0
    rotary = rerun(model, inputs)
    with torch.no_grad():
        for attn, q in zip(attentions(model), zeroed, strict=True):
            attn.get_parameter(f"{attn.q_proj}.weight").copy_(q)
    assert (rotary.abs() > 0.1 * s.abs()).all() and (rotary < 0.9 * s).all(), (rotary, s)
    tau = tau_between(s)
    before = qk_weights(model)
    clip_step(model, tau, toks)
    after = rerun(model, inputs)
    clipped = s > tau
    assert clipped.any() and (~clipped).any()
    q_name = "wq_b.weight" if q_lora_rank else "wq.weight"
    for layer, attn in enumerate(attentions(model)):
        w = {n: p.detach() for n, p in attn.named_parameters()}
        # the shared rotary key (wkv_a's last `rope` rows), the latent and the other down projections, the norms and
        # wo: the clip leaves them bitwise
        for name in w:
            if name not in (q_name, "wkv_b.weight"):
                assert torch.equal(w[name], before[layer][name]), name
        q_new, q_old = (t.view(heads, nope + rope, -1) for t in (w[q_name], before[layer][q_name]))
        k_new, k_old = (t.view(heads, nope + vdim, -1) for t in (w["wkv_b.weight"], before[layer]["wkv_b.weight"]))
        for h in range(heads):
            assert torch.equal(k_new[h, nope:], k_old[h, nope:])  # this head's value rows
            if not clipped[layer, h]:
                assert torch.equal(q_new[h], q_old[h]) and torch.equal(k_new[h], k_old[h])
                assert after[layer, h].item() == pytest.approx(s[layer, h].item(), rel=1e-6)
                continue
            gamma = tau / float(s[layer, h])
            torch.testing.assert_close(q_new[h, :nope], q_old[h, :nope] * math.sqrt(gamma), rtol=1e-5, atol=0)
            torch.testing.assert_close(q_new[h, nope:], q_old[h, nope:] * gamma, rtol=1e-5, atol=0)
            torch.testing.assert_close(k_new[h, :nope], k_old[h, :nope] * math.sqrt(gamma), rtol=1e-5, atol=0)
            assert after[layer, h].item() == pytest.approx(tau, rel=1e-5)


# ------------------------------------------------------------------------------------------ 4. gradient accumulation
def test_micro_batches_fold_into_one_max():
    # catches the last micro-batch overwriting the earlier ones (or summing them) instead of a max
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    toks = tokens(0, batch=8)
    halves = measured(model, toks[:4]), measured(model, toks[4:])
    assert (halves[0] > halves[1]).any() and (halves[1] > halves[0]).any()  # each half holds some heads' max
    clip = QKClip(model, math.inf, device="cpu")
    model(toks[:4])
    model(toks[4:])
    clip.launch()
    clip.wait()
    accumulated = clip.grid.clone()
    model(toks)
    clip.launch()
    clip.wait()
    torch.testing.assert_close(accumulated, clip.grid, rtol=1e-6, atol=0)
    torch.testing.assert_close(accumulated.double(), torch.maximum(*halves), rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------- 5. activation checkpointing
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_measures_the_same(use_reentrant):
    # catches a recompute that changes S, or (reentrant: the first forward runs without grad) one that is lost
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    clip = QKClip(model, math.inf, device="cpu")
    toks = tokens(0)
    model(toks).float().pow(2).mean().backward()
    clip.launch()
    clip.wait()
    plain = clip.grid.clone()
    model.zero_grad(set_to_none=True)
    for block in model.layers.values():
        block.forward = functools.partial(
            torch_checkpoint.checkpoint, block.forward, use_reentrant=use_reentrant
        )  # the instance attribute shadows the class's forward
    model(toks).float().pow(2).mean().backward()
    clip.launch()
    clip.wait()
    assert torch.isfinite(clip.grid).all()
    assert torch.equal(clip.grid, plain)


# -------------------------------------------------------------------------------------------- 6. measure-only, stats
def test_measure_only_changes_nothing_and_stats():
    # catches a clip under tau = inf (any weight touched) or a clipped-heads count where none is clipped
    model = build(llama3, "tinymodel", qk_scale=10.0)
    toks = tokens(0)
    s = measured(model, toks)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    clip = clip_step(model, math.inf, toks)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    stats = clip.stats()
    assert set(stats) == {"attn/max_logit", "attn/max_logit/layers.0.attention", "attn/max_logit/layers.1.attention"}
    assert stats["attn/max_logit"] == pytest.approx(float(s.max()), rel=1e-5)
    for i in range(2):
        assert stats[f"attn/max_logit/layers.{i}.attention"] == pytest.approx(float(s[i].max()), rel=1e-5)


def test_stats_count_clipped_heads():
    # catches a clipped-heads count over layers or kv heads instead of query heads, or of heads at/below tau
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    toks = tokens(0)
    s = measured(model, toks)
    tau = tau_between(s)
    clip = clip_step(model, tau, toks)
    stats = clip.stats()
    assert stats["attn/clipped_heads"] == float((s > tau).sum())
    assert 0 < stats["attn/clipped_heads"] < s.numel()
    assert stats["attn/max_logit"] == pytest.approx(float(s.max()), rel=1e-5)


# --------------------------------------------------------------------------------------------------- 7. off means off
def test_off_means_off_and_measuring_does_not_change_the_forward():
    # catches a layer measuring without a clip, or a measurement that alters q/k (in place) or the output
    off = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    on = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    QKClip(on, math.inf, device="cpu")
    assert all(a.max_logit is None for a in attentions(off))
    toks = tokens(0)
    out_off, out_on = off(toks), on(toks)
    assert all(a.max_logit is None for a in attentions(off))
    assert all(torch.isfinite(a.max_logit).all() for a in attentions(on))
    assert torch.equal(out_off, out_on)


# ------------------------------------------------------------------------------------------------------- 8. compile
@pytest.mark.slow
def test_compiled_attention_measures_as_eager():
    # catches a compiled forward that drops the in-place max (dynamo treating max_logit as a constant) or
    # overwrites it instead of folding in a later call
    model = build(llama3, "tinymodel_gqa", qk_scale=10.0)
    QKClip(model, math.inf, device="cpu")
    attn = model.layers["0"].attention
    (x1, rope), (x2, _) = attention_inputs(model, tokens(0))[0], attention_inputs(model, tokens(1))[0]
    eager = []
    for x in (x1, x2):
        attn.max_logit.fill_(-math.inf)
        attn(x, rope)
        eager.append(attn.max_logit.clone())
    assert (eager[0] > eager[1]).any() and (eager[1] > eager[0]).any()
    attn.max_logit.fill_(-math.inf)
    compiled = torch.compile(attn)
    try:
        compiled(x1, rope)
        torch.testing.assert_close(attn.max_logit, eager[0], rtol=1e-6, atol=0)
        compiled(x2, rope)
        torch.testing.assert_close(attn.max_logit, torch.maximum(*eager), rtol=1e-6, atol=0)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------- 9. bad taus
def test_invalid_tau():
    # catches a negative tau accepted (it would clip every head) or tau = 0 taken as a clip rather than "off"
    with pytest.raises(dmuon.OptionError, match="qk_clip_tau") as err:
        dmuon.MuonOptions(qk_clip_tau=-1)
    assert err.value.field == "qk_clip_tau"
    model = build(llama3, "tinymodel")
    with pytest.raises(ValueError, match="qk_clip_tau"):
        QKClip(model, 0, device="cpu")
    assert all(a.max_logit is None for a in attentions(model))


def test_max_logit_per_head_tiles_stay_within_the_budget() -> None:
    """Catches a tile that outgrows `chunk_elements` (the whole [L, L] of every head at once, or a per-tile copy of
    the keys): every matmul's logits stay within it, and the result is still the direct causal max."""
    torch.manual_seed(3)
    b, length, heads, kv, d, budget = 3, 64, 8, 2, 8, 4096  # B·H·L·L = 98304 logits, 24x the budget
    q, k = torch.randn(b, length, heads, d), torch.randn(b, length, kv, d)
    sizes: list[int] = []
    real_bmm = torch.bmm

    def counting_bmm(x, y):
        out = real_bmm(x, y)
        sizes.append(out.numel())
        return out

    with mock.patch.object(torch, "bmm", counting_bmm):
        got = max_logit_per_head(q, k, chunk_elements=budget)
    assert sizes and max(sizes) <= budget, max(sizes)
    kk = k.double().repeat_interleave(heads // kv, dim=2)
    logits = torch.einsum("blhd,bmhd->bhlm", q.double(), kk) / d**0.5
    want = logits.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
