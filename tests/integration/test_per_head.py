"""Per-head Muon through the framework (`optimizer.muon.per_head`, `per_head_wo`; docs/dmuon.md, "Per-head Muon").

In process: the llama3 family's head blocks, what the optimizer component hands the library, and the config errors
(a family without head blocks, per_head_wo alone). Through train.py (the tinymodel, 8 steps on the same global batch
of 8 x 32 tokens, read back from TensorBoard): dmuon with per-head q/k/v/o on dp2 x tp2 (4 ranks) equals its
1-process run and the muon_naive baseline with per_head on dp2 x tp2, at 5e-5; its ledger logs TP gathers and
scatters for the feed-forward matrices only (the heads stay on their TP ranks). The deepseek_v3 family's MLA blocks,
and dmuon equal to muon_naive with them (and not to the whole-matrix update).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train_runs import assert_same_run, read_scalars, run_train, tail, tiny_train_argv

STEPS = 8
PER_HEAD = ("--optimizer.muon.per_head", "true", "--optimizer.muon.per_head_wo", "true")
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4")


def component(*args: str, model_name: str = "llama3", optimizer: str = "dmuon"):
    """The optimizer component of a tinymodel config with `args`, and the model on meta."""
    from titan_dmuon.components.model import build_meta_model, get_model_spec
    from titan_dmuon.components.optimizer import build_optimizer_component
    from titan_dmuon.config import parse_args

    argv = ["--model.name", model_name, "--model.flavor", "tinymodel", "--optimizer.name", optimizer, *args]
    cfg = parse_args(argv)
    spec = get_model_spec(cfg.model.name)
    return build_optimizer_component(cfg, spec), build_meta_model(spec, cfg, 256)


def test_llama3_head_blocks():
    from titan_dmuon.models.llama3 import build_model, head_blocks

    tiny = head_blocks(build_model("tinymodel", vocab_size=256))  # dim 64, 4 heads of 16
    assert tiny == {
        f"layers.{i}.attention.{proj}.weight": (1 if proj == "wo" else 0, 16)
        for i in range(2)
        for proj in ("wq", "wk", "wv", "wo")
    }
    model = build_model("8B")  # GQA: wk/wv hold 8 kv heads of 128 rows, wq 32 query heads
    eight_b = head_blocks(model)
    assert eight_b["layers.0.attention.wk.weight"] == (0, 128) and eight_b["layers.31.attention.wo.weight"] == (1, 128)
    assert model.layers["0"].attention.wk.weight.shape[0] // 128 == 8


def test_deepseek_v3_mla_head_blocks():
    """MLA's heads: a head's rows of the query up-projection (non-rotary + rotary), of wkv_b (its key rows, then its
    value rows) and its columns of wo; the down projections (wq_a, wkv_a) are whole matrices."""
    from titan_dmuon.models.deepseek_v3 import SPEC, build_model

    tiny = SPEC.head_blocks(build_model("tinymodel", vocab_size=256))  # 4 heads: nope 16, rope 8, v 16
    assert tiny == {
        f"layers.{i}.attention.{proj}.weight": block
        for i in range(2)
        for proj, block in (("wq_b", (0, 24)), ("wkv_b", (0, 32)), ("wo", (1, 16)))
    }
    moonlight = SPEC.head_blocks(SPEC.build("moonlight_16b_a3b"))  # no query latent: wq itself, 16 heads of 192 rows
    assert moonlight["layers.26.attention.wq.weight"] == (0, 192)
    assert moonlight["layers.0.attention.wkv_b.weight"] == (0, 256)


def test_deepseek_v3_per_head_dmuon_equals_muon_naive(tmp_path):
    """Per-head Muon on MLA's blocks through train.py: dmuon (blocks batched by shape on the owner) and muon_naive
    (the gathered full matrix split the same way) train the same model."""
    argv = ("--model.name", "deepseek_v3", *PER_HEAD, "--training.local_batch_size", "4")
    dmuon = run(1, tmp_path / "dmuon", *argv)
    naive = run(1, tmp_path / "naive", *argv, "--optimizer.name", "muon_naive")
    assert_same_run(dmuon, naive, rtol=5e-5)
    whole = run(1, tmp_path / "whole", "--model.name", "deepseek_v3", "--training.local_batch_size", "4")
    assert whole["loss/train"][STEPS] != pytest.approx(dmuon["loss/train"][STEPS], rel=1e-4)  # the blocks changed it


def test_component_passes_the_family_blocks():
    dmuon_component, model = component("--optimizer.muon.per_head", "true")
    rows = dmuon_component.head_blocks(model)
    assert len(rows) == 6 and set(rows.values()) == {(0, 16)}  # wq/wk/wv of 2 blocks; wo needs per_head_wo
    both, model = component(*PER_HEAD, optimizer="muon_naive")
    assert len(both.head_blocks(model)) == 8
    only_wq, model = component(*PER_HEAD, "--optimizer.muon_params", r"attention\.wq")
    assert set(only_wq.head_blocks(model)) == {"layers.0.attention.wq.weight", "layers.1.attention.wq.weight"}
    off, model = component()
    assert off.head_blocks(model) == {}


def test_config_errors():
    from titan_dmuon.config import ConfigError, parse_args

    no_blocks, model = component("--optimizer.muon.per_head", "true", model_name="tiny_mlp")
    with pytest.raises(ConfigError, match=r"optimizer\.muon\.per_head needs .* but tiny_mlp declares none"):
        no_blocks.head_blocks(model)
    no_heads, model = component("--optimizer.muon.per_head", "true", "--optimizer.muon_params", "feed_forward")
    with pytest.raises(ConfigError, match=r"none of the llama3 family's head-blocked matrices is a Muon param"):
        no_heads.head_blocks(model)
    with pytest.raises(ConfigError, match=r"optimizer\.muon\.per_head_wo needs per_head=True"):
        parse_args(["--optimizer.muon.per_head_wo", "true"])


def run(nproc: int, dump: Path, *args: str) -> dict[str, dict[int, float]]:
    argv = tiny_train_argv(dump, "--training.steps", str(STEPS), "--metrics.log_freq", "1", *args, tensorboard=True)
    proc = run_train(nproc, argv, timeout=240)
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


@pytest.mark.slow
def test_dp2_tp2_per_head_matches_single_process_and_muon_naive(tmp_path):
    ref = run(1, tmp_path / "ref", *PER_HEAD, "--training.local_batch_size", "8")
    tp = run(4, tmp_path / "tp", *PER_HEAD, *TP2)
    naive = run(4, tmp_path / "naive", *PER_HEAD, *TP2, "--optimizer.name", "muon_naive")
    assert_same_run(tp, ref, rtol=5e-5)
    assert_same_run(naive, tp, rtol=5e-5)
    # TP bytes (fp32): each feed-forward matrix (w1, w3: 192x64, w2: 64x192) is gathered and scattered by the DP
    # owner of each of its 2 TP shards, each sending half of the 12,288 elements: 6 matrices x 2 x 6,144 x 4 B a
    # step over the 4 ranks. q/k/v/o (4 heads of 16, 2 per TP rank) add nothing: 32 KiB a rank a step saved.
    for kind in ("tp_gather", "tp_scatter"):
        assert set(tp[f"dmuon_mean/bytes_{kind}"].values()) == {6 * 2 * 6144 * 4 / 4}, kind
