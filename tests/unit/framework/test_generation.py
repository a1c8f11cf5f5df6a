"""titan_dmuon/components/generation.py and kv_cache.py: cached decoding against the model's plain forward, and the
sampler's cuts (greedy, top-k, top-p, seed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_dmuon.components.generation import Sampling, generate, next_tokens
from titan_dmuon.models.llama3 import llama3_configs
from titan_dmuon.models.llama3.model import Transformer


def _model(n_kv_heads: int | None = 2) -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(llama3_configs["tinymodel"], vocab_size=61, max_seq_len=64, n_kv_heads=n_kv_heads)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


def _greedy_without_cache(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The reference: the whole sequence through the plain (uncached, unpadded) forward at every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_batched_cached_greedy_equals_each_prompt_alone_uncached(n_kv_heads) -> None:
    model = _model(n_kv_heads)
    prompts = [[5, 9, 2, 33, 7, 1, 8], [4], [60, 3, 3]]  # left-padded to 7 in one batch
    out = generate(model, prompts, Sampling(max_new_tokens=12))
    assert out.tokens == [_greedy_without_cache(model, p, 12) for p in prompts]
    assert out.new_tokens == 36 and out.tokens_per_second() > 0


class _Recorder(torch.nn.Module):
    """The model as `generate` sees it, keeping each call's tokens and logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.layers = model, model.layers
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        logits = self.model(tokens, cache)
        self.calls.append((tokens.clone(), logits.clone()))
        return logits


def _family_model(family: str, flavor: str) -> torch.nn.Module:
    from titan_dmuon.models import llama3, qwen3

    build = {"llama3": llama3.build_model, "qwen3": qwen3.build_model}[family]
    overrides = {"n_kv_heads": 2} if family == "llama3" else {}
    torch.manual_seed(0)
    model = build(flavor, vocab_size=61, device="cpu", max_seq_len=64, **overrides)
    with torch.no_grad():  # peaked attention: a key's position moves the logits by far more than the tolerance
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
    return model.eval()


@pytest.mark.parametrize(
    ("family", "flavor"), [("llama3", "tinymodel"), ("qwen3", "tinymodel"), ("qwen3", "tinymodel_moe")]
)
def test_cached_logits_equal_a_full_forward_at_every_step(family, flavor) -> None:
    """Every logit `generate` decodes from (the prompts' prefill at each real position, then each decode step) equals
    the plain forward of that row's unpadded sequence so far, in fp32. Greedy tokens of a tiny model barely depend
    on position (an off-by-one position passes them); these logits do (a planted off-by-one moved them by 5e-3 on
    llama3, 3e-2 on qwen3)."""
    model = _family_model(family, flavor)
    prompts = [[5, 9, 2, 33, 7, 1, 8], [4], [60, 3, 3, 17]]  # left-padded by 0, 6 and 3 slots
    recorder = _Recorder(model)
    # sampled, not greedy: the rows feed varied tokens back (every row goes on: no end-of-sequence id)
    out = generate(recorder, prompts, Sampling(max_new_tokens=6, temperature=1.0, seed=5)).tokens
    assert [len(t) for t in out] == [6, 6, 6] and len(recorder.calls) == 6
    longest = max(len(p) for p in prompts)
    with torch.no_grad():
        (_, prefill), *steps = recorder.calls
        for row, prompt in enumerate(prompts):
            want = model(torch.tensor([prompt]))[0]
            torch.testing.assert_close(prefill[row, longest - len(prompt) :], want, rtol=1e-5, atol=1e-5)
        for i, (fed, logits) in enumerate(steps):
            assert fed[:, 0].tolist() == [t[i] for t in out]  # the token just sampled, fed back
            for row, prompt in enumerate(prompts):
                want = model(torch.tensor([prompt + out[row][: i + 1]]))[0, -1]
                where = f"decode step {i + 1}, row {row}"
                torch.testing.assert_close(
                    logits[row, -1], want, rtol=1e-5, atol=1e-5, msg=lambda m, where=where: f"{where}: {m}"
                )


def test_a_row_stops_at_eos_and_the_others_go_on() -> None:
    model = _model()
    prompts = [[5, 9, 2], [11, 12]]
    free = generate(model, prompts, Sampling(max_new_tokens=10)).tokens
    eos = free[0][3]  # the 4th token row 0 generates: it stops there, before it
    stopped = generate(model, prompts, Sampling(max_new_tokens=10), eos_id=eos).tokens
    assert stopped[0] == free[0][: free[0].index(eos)]
    want = free[1][: free[1].index(eos)] if eos in free[1] else free[1]
    assert stopped[1] == want


def test_longer_than_the_rope_table_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        generate(_model(), [[1] * 60], Sampling(max_new_tokens=10))


def _draws(logits: torch.Tensor, sampling: Sampling, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(sampling.seed)
    return {int(t) for _ in range(n) for t in next_tokens(logits, sampling, gen)}


def test_sampler_cuts() -> None:
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.5, 0.4, -1.0]])
    assert _draws(logits, Sampling(temperature=0.0)) == {0}
    assert _draws(logits, Sampling(temperature=1.0, top_k=1)) == {0}
    assert _draws(logits, Sampling(temperature=1.0, top_k=3)) == {0, 1, 2}
    # softmax: p0 = 0.31, p0 + p1 = 0.60, + p2 = 0.85; top_p 0.5 keeps the first two, 0.1 only the first
    assert _draws(logits, Sampling(temperature=1.0, top_p=0.5)) == {0, 1}
    assert _draws(logits, Sampling(temperature=1.0, top_p=0.1)) == {0}
    assert _draws(logits, Sampling(temperature=1.0), n=2000) == set(range(6))
    # a high temperature flattens: the unlikely token (p 0.016 at temperature 1, 0.14 at 10) comes up far more often
    hot, cold = Sampling(temperature=10.0, seed=1), Sampling(temperature=1.0, seed=1)
    gen_hot, gen_cold = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    rows = logits.expand(4000, -1)
    assert (next_tokens(rows, hot, gen_hot) == 5).sum() > 5 * int((next_tokens(rows, cold, gen_cold) == 5).sum())


def test_same_seed_same_text_other_seed_other_text() -> None:
    model = _model()
    sampling = Sampling(max_new_tokens=16, temperature=1.5, seed=3)
    a = generate(model, [[1, 2, 3]], sampling).tokens
    assert generate(model, [[1, 2, 3]], sampling).tokens == a
    assert generate(model, [[1, 2, 3]], dataclasses.replace(sampling, seed=4)).tokens != a


@pytest.mark.parametrize(
    "kwargs", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_bad_sampling_settings_name_the_setting(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Sampling(**kwargs)
