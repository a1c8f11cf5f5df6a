"""The deepseek_v3 configs as users launch them: train_configs/deepseek_v3_debug.toml trains on one CPU process, and
the dry run plans it (its header's expert-parallel command), train_configs/moonlight_16b_a3b.toml and
train_configs/kimi_k2.toml at the clusters their headers name: each fits an 80 GiB device, with every block matrix
and expert stack dedicated, and the activations the plan prints are the family's estimate
(titan_dmuon/models/common/memory.py, MLA and shared experts included, called here on the model built from the
config). tests/distributed/test_planner.py holds the planner itself to real runs.
"""

from __future__ import annotations

import json

import pytest

from tests.train_runs import read_scalars, run_train, tail

DEBUG = "train_configs/deepseek_v3_debug.toml"
GIB = 2.0**30


@pytest.mark.slow
def test_debug_config_trains_on_one_process(tmp_path) -> None:
    """A short run of the shipped debug config (its flavor, optimizer and data; a smaller batch): the loss falls and
    the MoE metrics are logged."""
    argv = ["--config", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "4"]
    argv += ["--training.local_batch_size", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1"]
    proc = run_train(1, argv, timeout=300)
    assert proc.returncode == 0, tail(proc)
    scalars = read_scalars(tmp_path / "tb")
    loss = scalars["loss/train"]
    assert sorted(loss) == [1, 2, 3, 4] and loss[4] < loss[1], loss
    assert set(scalars["moe/max_load"]) == {1, 2, 3, 4}


# (config, world, Muon matrices, expert stacks, extra arguments): the debug config's header command, and the two
# large configs at their headers' clusters. Matrices: a dense block holds its attention's (Moonlight: wq wkv_a
# wkv_b wo; Kimi K2 and debugmodel: wq_a wq_b wkv_a wkv_b wo) and w1 w2 w3; a sparse one also the shared experts'
# three and the three expert stacks.
PLANS = {
    "debug-ep2": (DEBUG, 4, 8 + 3 * 11, 3 * 3, ["--parallelism.expert_parallel_degree", "2"]),
    "moonlight_16b_a3b-32": ("train_configs/moonlight_16b_a3b.toml", 32, 7 + 26 * 10, 26 * 3, []),
    "kimi_k2-512": ("train_configs/kimi_k2.toml", 512, 8 + 60 * 11, 60 * 3, []),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_configs_plan_and_fit(name, tmp_path) -> None:
    from titan_dmuon.components.model import get_model_spec
    from titan_dmuon.config import parse_args
    from titan_dmuon.dtypes import to_dtype

    config, world, matrices, stacks, extra = PLANS[name]
    out = tmp_path / "plan.json"
    argv = ["--config", config, *extra, "--job.dry_run", "--job.dry_run_world_size", str(world)]
    proc = run_train(1, [*argv, "--job.dry_run_json", str(out)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    plan = json.loads(out.read_text())
    assert plan["planner"]["seconds"] < 60 and plan["planner"]["max_rss_bytes"] < 4 * 2**30, plan["planner"]
    cap, mem, lpt, comm = plan["capacity"], plan["memory_bytes"], plan["lpt"], plan["bytes_per_step"]
    assert cap["fits"] and cap["device_bytes"] == 80 * GIB and cap["peak_bytes"] == mem["peak_estimate"]["max"]
    assert cap["peak_bytes"] <= 0.9 * 80 * GIB, cap["peak_bytes"] / GIB  # under the planner's warning too
    assert lpt["matrices"] == matrices and comm["expert_stacks"] == stacks
    assert comm["moe_all_to_all"]["moe_layers"] == stacks // 3

    cfg = parse_args(["--config", config, *extra])
    t, ac = cfg.training, cfg.activation_checkpoint
    vocab = cfg.model.vocab_size or 258  # the debug config's byte tokenizer: 256 bytes + BOS/EOS
    spec = get_model_spec("deepseek_v3")
    model = spec.build(cfg.model.flavor, vocab_size=vocab, device="meta", max_seq_len=t.seq_len)
    assert model.num_params() == plan["config"]["params"]
    estimate = spec.activation_estimate(
        model,
        batch=t.local_batch_size,
        seq_len=t.seq_len,
        dtype_bytes=to_dtype(t.mixed_precision_param).itemsize,
        tp=cfg.parallelism.tensor_parallel_degree,
        ac_mode=ac.mode,
        ac_option=ac.selective_ac_option,
    )
    terms = mem["activation_terms"]
    for key in ("blocks", "head", "head_backward", "recompute", "total"):
        assert terms[key] == pytest.approx(getattr(estimate, key), rel=1e-12), key
