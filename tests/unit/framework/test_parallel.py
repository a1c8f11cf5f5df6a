"""ParallelDims degrees, the default Muon predicate and activation checkpointing that keeps FQNs (one process), and
when parallelize logs FSDP2's unit count (1 and 2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from titan_dmuon.components.optimizer import muon_predicate
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.models.llama3 import MUON_PARAMS, blocks, build_model
from titan_dmuon.parallel import ParallelDims, apply_ac


def _cfg(replicate=1, shard=-1, tp=1) -> JobConfig:
    cfg = JobConfig()
    p = cfg.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree = replicate, shard, tp
    return cfg


@pytest.mark.parametrize(
    "world,replicate,shard,tp,expect",
    [
        (1, 1, -1, 1, (1, 1, 1)),
        (4, 1, -1, 1, (1, 4, 1)),
        (4, 2, -1, 1, (2, 2, 1)),
        (4, 1, -1, 2, (1, 2, 2)),
        (8, 2, 2, 2, (2, 2, 2)),
    ],
)
def test_parallel_dims_from_config(world, replicate, shard, tp, expect) -> None:
    dims = ParallelDims.from_config(_cfg(replicate, shard, tp), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == expect
    assert dims.dp_world_size == expect[0] * expect[1]
    assert dims.hsdp == (expect[0] > 1) and dims.tp_enabled == (expect[2] > 1)


def test_parallel_dims_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        ParallelDims.from_config(_cfg(tp=3), 4)
    with pytest.raises(ConfigError, match="world size is 4"):
        ParallelDims.from_config(_cfg(replicate=2, shard=4), 4)
    with pytest.raises(ValueError, match="world_size"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=1, world_size=8)


def test_one_rule_for_the_expert_degree() -> None:
    """The config's check at launch and ParallelDims say the same thing (one rule: config/manager.py)."""
    cfg = _cfg(shard=2, tp=2)
    cfg.parallelism.expert_parallel_degree = 4
    rule = r"expert_parallel_degree \(4\) must divide data_parallel_shard_degree \(2\)"
    with pytest.raises(ConfigError, match=rule):
        ParallelDims.from_config(cfg, 4)
    with pytest.raises(ValueError, match=rule):
        ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=4, ep=4)
    with pytest.raises(ValueError, match=r"expert_parallel_degree must be >= 1, got 0"):
        ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=4, ep=0)


@pytest.mark.parametrize(
    "P,R,S,T,E", [(1, 1, 1, 1, 1), (1, 2, 4, 2, 1), (1, 1, 8, 2, 2), (2, 2, 4, 2, 4), (4, 4, 32, 8, 8), (4, 1, 1, 1, 1)]
)
def test_coordinates_need_no_process_group(P, R, S, T, E) -> None:
    """Row-major over (pp, replicate, shard, tp), shard = efsdp x ep (ep inner), expert_shard = efsdp x tp: rank_of
    and expert_rank_of invert the coordinates, each axis's groups split the world into groups of the axis's size
    whose members differ on that axis only, and no group but the pp axis's crosses a pipeline stage
    (tests/distributed/test_parallel_dims.py checks these against the real meshes)."""
    dims = ParallelDims(dp_replicate=R, dp_shard=S, tp=T, world_size=P * R * S * T, ep=E, pp=P)
    c = {k: v.tolist() for k, v in dims.coordinates().items()}
    sizes = dims.axis_sizes()
    assert set(c) == set(sizes) and sizes["expert_shard"] == dims.expert_shard_size == S // E * T
    assert dims.stage_size == R * S * T
    for g in range(dims.world_size):
        assert c["pp"][g] == g // (R * S * T)
        assert dims.rank_of(c["replicate"][g], c["shard"][g], c["tp"][g], c["pp"][g]) == g
        assert dims.expert_rank_of(c["replicate"][g], c["expert_shard"][g], c["ep"][g], c["pp"][g]) == g
        assert c["shard"][g] == c["efsdp"][g] * E + c["ep"][g]
        assert c["expert_shard"][g] == c["efsdp"][g] * T + c["tp"][g]
    assert dims.groups("tp")[0] == list(range(T)) and dims.groups("ep")[0] == [e * T for e in range(E)]
    assert dims.groups("pp")[0] == [p * R * S * T for p in range(P)]
    for axis, size in sizes.items():
        groups = dims.groups(axis)
        assert sorted(g for group in groups for g in group) == list(range(dims.world_size)), axis
        assert all(len(group) == size for group in groups), axis
        for group in groups:
            assert [c[axis][g] for g in group] == list(range(size)), axis
            if axis != "pp":
                assert len({c["pp"][g] for g in group}) == 1, axis
    with pytest.raises(ValueError, match="unknown mesh axis 'dp'"):
        dims.groups("dp")
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = dims.meshes


def test_default_muon_predicate_selects_block_matrices_only() -> None:
    model = build_model("tinymodel", vocab_size=64)  # meta: names and shapes only
    pred = muon_predicate(MUON_PARAMS)
    selected = sorted(n for n, p in model.named_parameters() if pred(n, p))
    per_block = [
        "attention.wk.weight",
        "attention.wo.weight",
        "attention.wq.weight",
        "attention.wv.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    ]
    assert selected == [f"layers.{i}.{n}" for i in range(2) for n in per_block]


@pytest.mark.parametrize(
    "mode,option,expect",
    [
        ("none", "2", []),
        ("selective", "2", ["layers.0", "layers.2"]),
        ("selective", "3", ["layers.0"]),
        ("selective", "1", ["layers.0", "layers.1", "layers.2"]),
        ("selective", "op", ["layers.0", "layers.1", "layers.2"]),
        ("full", "2", ["layers.0", "layers.1", "layers.2"]),
    ],
)
def test_activation_checkpointing_keeps_fqns_and_gradients(mode, option, expect) -> None:
    torch.manual_seed(0)
    ref = build_model("tinymodel", vocab_size=64, device="cpu", n_layers=3, max_seq_len=16)
    model = copy.deepcopy(ref)
    assert apply_ac(blocks(model), mode, option) == expect
    # The module tree is untouched: same FQNs (DMuon's hook boundaries and the muon_params regex rely on it).
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref.named_modules()]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        F.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    # Forward hooks on a block still fire around the checkpointed body.
    calls = []
    model.layers["0"].register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    model(tokens)
    assert calls == ["pre"]


def test_family_without_tp_plan_is_a_config_error() -> None:
    from types import SimpleNamespace

    from titan_dmuon.components.model import get_model_spec
    from titan_dmuon.parallel.parallelize import apply_tensor_parallel

    spec = get_model_spec("tiny_mlp")
    model = spec.build("tinymodel", vocab_size=64)
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 2: model family tiny_mlp has no TP plan"):
        apply_tensor_parallel(model, SimpleNamespace(size=lambda: 2), JobConfig(), spec)


def test_fsdp_blocks_keeps_blocks_with_enough_params() -> None:
    """A block is its own FSDP2 unit while FSDP2 shards >= 1% of its params: not when the optimizer took all
    but its norms, nor when it took everything."""
    import torch.nn as nn

    from titan_dmuon.parallel import fsdp_blocks

    def block(n_matrix: int, n_norm: int) -> nn.Module:
        b = nn.Module()
        b.w = nn.Parameter(torch.zeros(n_matrix))
        b.norm = nn.Parameter(torch.zeros(n_norm))
        return b

    blocks = [("a", block(199, 1)), ("b", block(99, 1)), ("c", block(100, 0))]
    assert fsdp_blocks(blocks, set()) == [b for _, b in blocks]
    ignored = {b.w for _, b in blocks}
    assert fsdp_blocks(blocks, ignored) == [blocks[1][1]]  # 0.5% kept: none; 1%: a unit; nothing kept: none


def _fsdp2_lines(rank: int, world: int, replicate: int) -> list[str]:
    """The FSDP2 unit-count lines parallelize logs for the tiny model under DMuon (no block keeps 1% for FSDP2)."""
    import logging

    from tests.optimizer_components import build_tiny, tiny_cfg

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("titan_dmuon.parallel.parallelize")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    dims = ParallelDims(dp_replicate=replicate, dp_shard=world // replicate, tp=1, world_size=world)
    _, component = build_tiny(tiny_cfg("dmuon"), dims)
    component.close()
    return [r.getMessage() for r in records if r.getMessage().startswith("FSDP2:")]


@pytest.mark.parametrize(("world", "replicate", "logged"), [(1, 1, False), (2, 2, False), (2, 1, True)])
def test_fsdp2_unit_count_is_logged_only_with_a_shard_axis(world, replicate, logged) -> None:
    """One process or DDP (shard degree 1): FSDP2 shards nothing, so its unit count says nothing; FSDP 2 logs it."""
    from tests._dist import run_distributed

    lines = run_distributed(_fsdp2_lines, world, replicate)
    assert lines[0] == (
        [
            "FSDP2: 0 of 2 blocks are units of their own; the other blocks keep under 1% of their params "
            "once the optimizer's are set aside, and the root unit gathers those"
        ]
        if logged
        else []
    )


@pytest.mark.parametrize("option", ["0", "-1", "two", "ops"])
def test_selective_ac_option_must_be_op_or_a_positive_integer(option) -> None:
    model = build_model("tinymodel", vocab_size=64, device="cpu", n_layers=2, max_seq_len=16)
    with pytest.raises(ConfigError, match=r"selective_ac_option must be 'op' or a positive integer"):
        apply_ac(blocks(model), "selective", option)


def test_op_level_ac_recomputes_only_what_it_does_not_keep() -> None:
    """Per op: the forward saves the outputs of SDPA and of every other matmul; the recompute in backward runs
    the other matmuls again (3 of a block's 7) and SDPA not at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model("tinymodel", vocab_size=64, device="cpu", n_layers=1, max_seq_len=16)
    apply_ac(blocks(model), "selective", "op")
    x = torch.randn(2, 16, model.args.dim, requires_grad=True)
    out = model.layers["0"](x, model.rope_cache)
    with Count() as seen:
        out.sum().backward()
    recomputed_mm = seen.ops.count("mm") - 2 * 7  # each of the 7 matmuls has two in its backward
    assert recomputed_mm == 3, seen.ops
    assert not [op for op in seen.ops if op.startswith("_scaled_dot_product") and "backward" not in op], seen.ops
