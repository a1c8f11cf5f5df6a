"""The optimizer components (dmuon, muon_naive, adamw) through the protocol the trainer uses, in one process
on a 1-rank gloo group: prepare inside parallelize, build, no_sync, clip, step_stats, a state_dict round trip,
close; and muon_naive's update equal to dmuon.Muon's for the same options."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.optimizer_components import build_tiny, tiny_batch, tiny_cfg, train_step
from titan_dmuon.components.model import get_model_spec
from titan_dmuon.components.optimizer import (
    NaiveMuon,
    available_optimizers,
    build_optimizer_component,
    get_optimizer_component,
)
from titan_dmuon.config import ConfigError
from titan_dmuon.parallel import ParallelDims

_MATRICES = [f"attention.{w}" for w in ("wk", "wo", "wq", "wv")] + [f"feed_forward.w{i}" for i in (1, 2, 3)]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    finally:
        dist.destroy_process_group()


def test_registry_lists_the_three() -> None:
    assert available_optimizers() == ["adamw", "dmuon", "muon_naive"]
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; registered optimizers: adamw, dmuon, muon_naive"):
        get_optimizer_component("sgd")
    with pytest.raises(ConfigError, match=r"optimizer\.name: unknown optimizer 'sgd'"):
        build_optimizer_component(tiny_cfg("sgd"), get_model_spec("llama3"))


@pytest.mark.parametrize("name", ["dmuon", "muon_naive", "adamw"])
def test_protocol(one_rank, name) -> None:
    model, component = build_tiny(tiny_cfg(name), one_rank)
    opt = component.optimizer
    kinds = sorted({g["kind"] for g in opt.param_groups})
    assert kinds == (["adamw"] if name == "adamw" else ["adamw", "muon"])
    # FSDP2 manages every param but DMuon's dedicated matrices (passed to fully_shard as ignored_params).
    plain = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    assert plain == ([f"layers.{i}.{m}.weight" for i in range(2) for m in _MATRICES] if name == "dmuon" else [])
    losses = [train_step(model, component, step)[0] for step in range(6)]
    assert losses[-1] < losses[0]
    stats = component.step_stats()
    # One rank: no collective moves anything, so no byte series; the Muon ones count their Newton-Schulz runs.
    expected = {"adamw": set(), "dmuon": {"dmuon/ns_calls", "dmuon/ns_time_s"}}
    assert set(stats) == expected.get(name, {"muon_naive/ns_calls", "muon_naive/ns_time_s"})
    if name != "adamw":
        assert stats[f"{name}/ns_calls"] == 14.0
    component.close()


@pytest.mark.parametrize("name", ["dmuon", "muon_naive", "adamw"])
def test_fsdp_units(one_rank, name) -> None:
    """Under DMuon a block keeps only its norms for FSDP2: no unit of its own (its norms join the root's, one
    all-gather per step instead of three small collectives per block); under the others every block is a unit."""
    from torch.distributed.fsdp import FSDPModule

    model, component = build_tiny(tiny_cfg(name), one_rank)
    units = [isinstance(block, FSDPModule) for _, block in component.spec.blocks(model)]
    assert units == [name != "dmuon"] * 2
    assert isinstance(model, FSDPModule)
    # the norms are still FSDP2's (DTensors, now of the root unit) and train: their grads reach the optimizer
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert norms and all(isinstance(p, DTensor) for p in norms.values())
    before = {n: p.full_tensor().clone() for n, p in norms.items()}
    for step in range(2):
        train_step(model, component, step)
    assert all(not torch.equal(before[n], p.full_tensor()) for n, p in norms.items())
    component.close()


@pytest.mark.parametrize("name", ["dmuon", "adamw"])
def test_bf16_blocks_get_the_fp32_rope_table(one_rank, name) -> None:
    """Under bf16 mixed precision a block computes in bf16 but rotates by the exact fp32 RoPE table, whether it
    is an FSDP2 unit (adamw) or not (dmuon): FSDP2 would otherwise cast that input to bf16 for units only, and the
    two optimizers would train different models."""
    cfg = tiny_cfg(name)
    cfg.training.mixed_precision_param = "bfloat16"
    model, component = build_tiny(cfg, one_rank)
    seen = []
    block = component.spec.blocks(model)[0][1]
    handle = block.register_forward_pre_hook(lambda _m, args: seen.append([a.dtype for a in args]))
    model(tiny_batch(0)[:, :-1])
    handle.remove()
    assert seen == [[torch.bfloat16, torch.float32]]
    component.close()


def _state_tensors(sd: dict) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                out[f"{fqn}/{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


@pytest.mark.parametrize("name", ["dmuon", "muon_naive", "adamw"])
def test_state_dict_round_trip(one_rank, name) -> None:
    """state_dict after 2 steps, cleared state, load_state_dict: the same state back, and step 3 trains exactly
    like an uninterrupted run's."""
    model, component = build_tiny(tiny_cfg(name), one_rank)
    ref_model, ref = build_tiny(tiny_cfg(name), one_rank)
    for step in range(2):
        train_step(model, component, step)
        train_step(ref_model, ref, step)
    saved = copy.deepcopy(component.state_dict())
    before = _state_tensors(saved)
    assert any(k.endswith("momentum_buffer") for k in before) == (name != "adamw")
    assert any(k.endswith("exp_avg") for k in before)
    component.optimizer.state.clear()
    component.load_state_dict(copy.deepcopy(saved))
    after = _state_tensors(component.state_dict())
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)
    assert train_step(model, component, 2) == train_step(ref_model, ref, 2)
    component.close()
    ref.close()


def test_muon_naive_update_equals_dmuon(one_rank) -> None:
    """Non-default options on both sides (weight decay, no Nesterov, original lr scaling, Keller Jordan's
    coefficients, 3 NS steps): muon_naive trains the same model as dmuon."""
    options = dict(
        weight_decay=0.1, nesterov=False, adjust_lr_fn="original", ns_coefficients="muon", ns_steps=3, lr=0.05
    )
    runs = {}
    for name in ("dmuon", "muon_naive"):
        model, component = build_tiny(tiny_cfg(name, **options), one_rank)
        runs[name] = [train_step(model, component, step, max_norm=0.5) for step in range(4)]
        component.close()
    torch.testing.assert_close(runs["muon_naive"], runs["dmuon"], rtol=1e-6, atol=0)


def test_naive_muon_param_groups_follow_the_scheduler() -> None:
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    opt = NaiveMuon([a], [b], lr=0.02, adamw_lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == {"muon": 0.01, "adamw": 5e-4}
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        NaiveMuon([a], [b], adjust_lr_fn="rms")


@pytest.mark.parametrize("name", ["dmuon", "muon_naive"])
def test_muon_takes_3d_params_only_as_moe_expert_stacks(name) -> None:
    """A 3-D param Muon would orthogonalize slice by slice: right for an MoE layer's expert stacks (found through
    the MoE protocol), a ConfigError naming the param for any other (a regex that matches too much)."""
    from titan_dmuon.components.moe import moe_layers

    moe_cfg = tiny_cfg(name)
    moe_cfg.model.name, moe_cfg.model.flavor = "qwen3", "tinymodel_moe"
    spec = get_model_spec("qwen3")
    model = spec.build("tinymodel_moe", vocab_size=64, max_seq_len=16)  # meta
    component = build_optimizer_component(moe_cfg, spec)
    stacks = {id(p) for layer in moe_layers(model) for p in layer.expert_params().values()}
    selected = component.select_muon_params(model)
    assert {id(p) for _, p in selected if p.ndim == 3} == stacks and stacks
    model.layers["0"].attention.register_parameter("stray", torch.nn.Parameter(torch.empty(2, 3, 4, device="meta")))
    moe_cfg.optimizer.muon_params = r"^layers\.\d+\.(attention\.stray|feed_forward\.experts\.w\d)$"
    with pytest.raises(
        ConfigError, match=r"3-D parameters that are no MoE layer's expert stack: layers\.0\.attention\.stray;"
    ):
        build_optimizer_component(moe_cfg, spec).select_muon_params(model)


@pytest.mark.parametrize("name", ["dmuon", "muon_naive", "adamw"])
def test_qk_clip_in_every_component(one_rank, name) -> None:
    """optimizer.muon.qk_clip_tau on each component: its step stats carry the max logits and the clipped heads, and
    a tau under the tiny model's logits (about 0.1 at init) clips heads."""
    model, component = build_tiny(tiny_cfg(name, qk_clip_tau=0.01), one_rank)
    train_step(model, component, 0)
    stats = component.step_stats()
    layers = [f"attn/max_logit/layers.{i}.attention" for i in range(2)]
    assert stats["attn/max_logit"] == max(stats[k] for k in layers) > 0.01
    assert stats["attn/clipped_heads"] > 0
    component.close()


def test_qk_clip_on_a_model_without_attention_is_a_config_error(one_rank) -> None:
    cfg = tiny_cfg("dmuon", qk_clip_tau=100.0)
    cfg.model.name = "tiny_mlp"
    with pytest.raises(ConfigError, match=r"qk_clip_tau.*tiny_mlp/tinymodel has no attention layer"):
        build_tiny(cfg, one_rank)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_tp_distributed_gram_policy_reaches_dmuon(one_rank, policy) -> None:
    """[optimizer.dmuon] tp_distributed_gram(_policy) reach dmuon.Muon; without TP no matrix has a TP path (the
    start-up log prints none); dmuon.Muon refuses a value outside the three, naming it and the choices."""
    from titan_dmuon import dmuon

    cfg = tiny_cfg("dmuon")
    cfg.optimizer.dmuon.tp_distributed_gram = True
    cfg.optimizer.dmuon.tp_distributed_gram_policy = policy
    model, component = build_tiny(cfg, one_rank)
    opt = component.optimizer
    assert (opt.tp_distributed_gram, opt.tp_distributed_gram_policy) == (True, policy)
    assert dmuon.tp_paths(model, opt) == [] and dmuon.describe_tp_paths(model, opt) == ""
    assert dmuon.Muon(model).tp_distributed_gram_policy == "beneficial"  # the library's default
    with pytest.raises(
        ValueError,
        match=r"tp_distributed_gram_policy must be one of 'beneficial', 'always', 'never', "
        r"got 'sometimes'",
    ):
        dmuon.Muon(model, tp_distributed_gram=True, tp_distributed_gram_policy="sometimes")
    component.close()


def test_tp_gather_reaches_dmuon(one_rank) -> None:
    """[optimizer.dmuon] tp_gather reaches dmuon.Muon, whose default is "backward"; dmuon.Muon refuses another
    value, naming it and the choices."""
    from titan_dmuon import dmuon

    cfg = tiny_cfg("dmuon")
    cfg.optimizer.dmuon.tp_gather = "step"
    model, component = build_tiny(cfg, one_rank)
    assert component.optimizer.tp_gather == "step"
    assert dmuon.Muon(model).tp_gather == "backward"
    with pytest.raises(ValueError, match=r"tp_gather.*'backward' or 'step', got 'sideways'"):
        dmuon.Muon(model, tp_gather="sideways")
    component.close()
