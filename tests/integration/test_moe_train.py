"""Qwen3-MoE through train.py as users launch it: train_configs/qwen3_moe_debug.toml with the debugmodel_moe flavor
on 4 ranks with expert parallelism 2 (torchrun): the MoE metrics in TensorBoard and DMuon's expert traffic (dmuon
owns each expert stack's EP shard on one rank of its expert-data-parallel pair). The correctness of dmuon and of
muon_naive on these layouts, against an independent reference, is tests/distributed/test_moe_layouts.py's.

A second run saves a checkpoint at step 3 on those 4 ranks; resumed on the same layout its steps 4-6 are bitwise the
straight dmuon run's (which never saved), and resumed on 2 ranks without expert parallelism (each rank every expert,
local batch 4: the same global batch) its steps 4 and 5 are, to 1e-5. The lr schedule does not depend on the run's
length (no decay), so a 3-step run trains its steps as the 6-step ones do.
"""

from __future__ import annotations

import shutil

import pytest

from tests.train_runs import read_scalars, run_train, tail, tiny_train_argv

STEPS = 6
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.steps", str(STEPS)]
MOE += ["--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]
EP2 = ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]


def _train(dump, *extra: str, nproc: int = 4) -> dict[str, dict[int, float]]:
    argv = tiny_train_argv(dump, *MOE, *extra, tensorboard=True, config="train_configs/qwen3_moe_debug.toml")
    proc = run_train(nproc, argv, timeout=300)
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


@pytest.mark.slow
def test_ep2_dmuon_logs_moe_metrics_and_resumes_without_ep(tmp_path) -> None:
    dmuon = _train(tmp_path / "dmuon", *EP2)
    assert set(dmuon["moe/aux_loss"]) == set(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert 0.5 < dmuon["moe/aux_loss"][step] < 8  # E * sum f_e P_e: top_k (=2) when balanced
        assert dmuon["moe/min_load"][step] <= 1 <= dmuon["moe/max_load"][step]
    # dmuon's expert stacks move over their expert-data-parallel pair: broadcasts and reduces, no TP gather
    assert dmuon["dmuon/bytes_broadcast"][STEPS] > 0 and dmuon["dmuon/bytes_reduce"][STEPS] > 0

    save = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    _train(tmp_path / "saver", *EP2, *save, "--training.steps", "3")
    # the same layout: bitwise the straight run (which never saved) from step 4 on
    same = _resume(tmp_path, "same", *EP2, *save)
    # 2 ranks, no expert parallelism: the checkpoint reshards (every expert on every rank); steps 4 and 5 (the
    # weights and the data position, then the optimizer state) to 1e-5: later steps drift apart as any two layouts do
    other = _resume(tmp_path, "other", *save, "--training.local_batch_size", "4", nproc=2)
    for tag in ("loss/train", "grad_norm"):
        assert sorted(same[tag]) == sorted(other[tag]) == [4, 5, 6]
        for step in (4, 5, 6):
            assert same[tag][step] == dmuon[tag][step], (tag, step)
        for step in (4, 5):
            assert other[tag][step] == pytest.approx(dmuon[tag][step], rel=1e-5), (tag, step)


def _resume(tmp_path, name: str, *extra: str, nproc: int = 4) -> dict[str, dict[int, float]]:
    """A run in a folder that holds only the saver's step-3 checkpoint: it resumes there, to step 6."""
    (tmp_path / name / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "saver" / "checkpoint" / "step-3", tmp_path / name / "checkpoint" / "step-3")
    return _train(tmp_path / name, *extra, nproc=nproc)


@pytest.mark.slow
def test_initial_load_from_hf_moe_folder_on_ep2_matches_1_process(tmp_path) -> None:
    """A Qwen3-MoE Hugging Face folder (per-expert tensors) loaded on 4 ranks with EP 2, under dmuon (each rank's
    EP shard of every stack, on its owner column) and under muon_naive (FSDP2 over the expert-DP pair: each rank
    reads only the experts of its shard), starts from the 1-process model: the same first loss."""
    import torch

    from titan_dmuon.components.checkpoint.hf_io import export_hf
    from titan_dmuon.models.qwen3 import SPEC, build_model

    torch.manual_seed(123)
    model = build_model("debugmodel_moe", vocab_size=258, device="cpu", max_seq_len=32)
    with torch.no_grad():  # far from the runs' seeded init
        for p in model.parameters():
            p.mul_(3)
    export_hf(model.state_dict(), tmp_path / "hf", SPEC.state_dict_adapter(model))
    load = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "1"]
    one = _train(tmp_path / "one", *load, "--training.local_batch_size", "8", nproc=1)
    for name, extra in (("dmuon", []), ("naive", ["--optimizer.name", "muon_naive"])):
        got = _train(tmp_path / name, *load, *EP2, *extra)
        assert got["loss/train"][1] == pytest.approx(one["loss/train"][1], rel=1e-5), name
