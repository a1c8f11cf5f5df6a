"""train.py end to end, launched as users launch it (`python train.py` / torchrun), on 1, 2, 4 and 8 CPU ranks.

Every run trains the `tinymodel` flavor for 20 steps on the same global batch of 8 x 32 tokens, so the losses
of every layout can be compared with the single-process run's: the data stream gives DP rank r the windows
r, r+N, r+2N, ..., hence the N ranks' micro-batches of one step hold exactly the windows of the single
process's batch, and the mean over ranks of the per-rank mean losses is the single process's mean loss.
Losses, grad norms and the DMuon byte counts are read back from the TensorBoard events (EventAccumulator).

Layouts (each with DMuon once, each optimizer at least once):
  1 process       dmuon (reference, with validation, and the saved config), adamw (reference),
                  muon_naive == reference, the tiny_mlp family, dmuon + compile + AC full
  4 ranks         1D FSDP dmuon == reference; 1D FSDP muon_naive == that dmuon run (1e-5);
                  HSDP 2x2 dmuon + AC full + grad accumulation == reference;
                  dp2 x tp2 adamw + AC selective + grad accumulation == adamw reference;
                  dp2 x tp2 dmuon == reference
  8 ranks         2 x 2 x 2 dmuon == reference
  2 ranks         a diverging run (lr 1e30) stops every rank with a non-zero exit
  1 process       config errors exit 2 naming the key (and listing the registered names)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.train_runs import (
    TRAIN_STEPS,
    assert_loss_falls,
    assert_same_run,
    read_scalars,
    run_train,
    tail,
    train,
    train_argv,
)


def read_text(tb_dir: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    ea.Reload()
    (event,) = ea.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def dmuon_total(scalars, key: str) -> float:
    return sum(scalars[f"dmuon/{key}"].values())


def byte_kinds(scalars) -> set[str]:
    """The DMuon collective kinds logged (only those whose mesh axis has more than one rank)."""
    return {tag.removeprefix("dmuon/bytes_") for tag in scalars if tag.startswith("dmuon/bytes_")}


# ------------------------------------------------------------------------------------------ references
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process, dmuon, local batch 8 (the global batch of every run below), validation every 10 steps."""
    return train(
        1,
        tmp_path_factory.mktemp("ref_dmuon"),
        "--training.local_batch_size",
        "8",
        "--validation.enable",
        "true",
        "--validation.freq",
        "10",
        "--validation.steps",
        "2",
    )


@pytest.fixture(scope="module")
def dmuon_4_ranks(tmp_path_factory):
    """1D FSDP on 4 ranks, dmuon: 4 x 2 sequences, the reference's global batch."""
    return train(4, tmp_path_factory.mktemp("dmuon_4"), "--training.local_batch_size", "2")


@pytest.fixture(scope="module")
def reference_adamw(tmp_path_factory):
    return train(
        1, tmp_path_factory.mktemp("ref_adamw"), "--training.local_batch_size", "8", "--optimizer.name", "adamw"
    )


def test_single_process_dmuon(reference, tmp_path_factory) -> None:
    assert_loss_falls(reference)
    tags = set(reference)
    expected = {
        "loss/train",
        "grad_norm",
        "lr/muon",
        "lr/adamw",
        "progress/tokens_seen",
        "progress/elapsed_s",
        "throughput/tokens_per_sec",
        "throughput/tokens_per_sec_global",
        "throughput/tflops",
        "memory/rss_gib",
        "dmuon/ns_calls",
        "dmuon/ns_time_s",
        "loss/validation",
        "perplexity/validation",
    }
    assert expected <= tags, sorted(expected - tags)
    # One process: every one of the 14 block matrices is owned here, and nothing moves (so no byte series).
    assert set(reference["dmuon/ns_calls"].values()) == {14.0}
    assert byte_kinds(reference) == set()
    assert not any(tag.startswith("dmuon_mean/") for tag in tags)  # one rank: the max is the figure
    assert reference["throughput/tokens_per_sec_global"] == reference["throughput/tokens_per_sec"]
    # Warmup (5 steps) from (step+1)/6 of the configured lrs (Muon 0.01, AdamW 3e-3).
    assert reference["lr/muon"][1] == pytest.approx(0.01 / 6)
    assert reference["lr/adamw"][5] == pytest.approx(3e-3 * 5 / 6)
    assert reference["progress/tokens_seen"][TRAIN_STEPS] == TRAIN_STEPS * 8 * 32
    # Validation at steps 10 and 20; perplexity = exp(mean loss).
    val = reference["loss/validation"]
    assert sorted(val) == [10, 20]
    for step, v in val.items():
        assert reference["perplexity/validation"][step] == pytest.approx(math.exp(v), rel=1e-5)
    assert val[20] < val[10]


def test_single_process_adamw(reference_adamw) -> None:
    assert_loss_falls(reference_adamw)
    assert not any(tag.startswith("dmuon/") or tag == "lr/muon" for tag in reference_adamw)
    assert reference_adamw["lr/adamw"][1] == pytest.approx(3e-3 / 6)


def test_saved_config_repeats_the_run(tmp_path) -> None:
    """<dump_folder>/config.toml and the TensorBoard text hold the resolved config, with the seed drawn when
    training.seed is unset; training from that file repeats the run."""
    from titan_dmuon.config import load_toml

    first = train(1, tmp_path / "a", "--training.steps", "3", "--training.seed", "None", "--optimizer.name", "adamw")
    saved = load_toml(tmp_path / "a" / "config.toml")
    assert saved.training.seed is not None and saved.optimizer.name == "adamw" and saved.training.steps == 3
    assert "[optimizer.adamw]" in read_text(tmp_path / "a" / "tb", "config")
    proc = run_train(1, ["--config", str(tmp_path / "a" / "config.toml"), "--job.dump_folder", str(tmp_path / "b")])
    assert proc.returncode == 0, tail(proc)
    assert f"Seed {saved.training.seed}" in proc.stderr
    again = read_scalars(tmp_path / "b" / "tb")
    assert again["loss/train"] == first["loss/train"]


def test_single_process_muon_naive_matches_dmuon(tmp_path, reference) -> None:
    s = train(1, tmp_path, "--training.local_batch_size", "8", "--optimizer.name", "muon_naive")
    assert_same_run(s, reference, rtol=1e-5)
    assert set(s["muon_naive/ns_calls"].values()) == {14.0}
    assert "muon_naive/bytes_all_gather" not in s  # one rank gathers nothing


def test_tiny_mlp_family_trains(tmp_path) -> None:
    s = train(1, tmp_path, "--model.name", "tiny_mlp", "--training.local_batch_size", "8")
    assert_loss_falls(s)
    assert set(s["dmuon/ns_calls"].values()) == {6.0}  # 2 blocks x (gate, up, down)


# ----------------------------------------------------------------------------------------- multi-rank
@pytest.mark.slow
def test_fsdp_4_ranks_matches_single_process(dmuon_4_ranks, reference) -> None:
    s = dmuon_4_ranks
    assert_loss_falls(s)
    assert_same_run(s, reference)
    assert byte_kinds(s) == {"broadcast", "reduce"}  # 1D: the replicate and TP kinds are not logged
    assert dmuon_total(s, "bytes_broadcast") > 0 and dmuon_total(s, "bytes_reduce") > 0
    assert max(s["dmuon/ns_calls"].values()) < 14  # the busiest rank owns only its share of the matrices
    assert set(s["dmuon_mean/ns_calls"].values()) == {14 / 4}  # over the 4 ranks: each matrix once
    for step, tps in s["throughput/tokens_per_sec"].items():  # per rank, and the 4 ranks' together
        assert s["throughput/tokens_per_sec_global"][step] == pytest.approx(4 * tps, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("reshard,ac", [("always", "full"), ("never", "selective")])
def test_root_reshard_modes_match_single_process(tmp_path, reference, reshard, ac) -> None:
    """Under dmuon the blocks are no FSDP2 units, so their norms live in the root unit: resharded after forward
    ("always": gathered again for backward and the checkpointed blocks' recompute) or kept ("never"), the run
    is still the reference's."""
    s = train(
        2,
        tmp_path,
        "--training.local_batch_size",
        "4",
        "--parallelism.fsdp_reshard_after_forward",
        reshard,
        "--activation_checkpoint.mode",
        ac,
    )
    assert_same_run(s, reference)


@pytest.mark.slow
def test_hsdp_2x2_activation_checkpointing_grad_accumulation(tmp_path, reference) -> None:
    """HSDP (replicate 2 x shard 2), every block checkpointed, 2 micro-batches of 1 per rank (dmuon.no_sync on
    the first): still the reference's global batch, so still the reference's losses (AC recomputes exactly)."""
    s = train(
        4,
        tmp_path,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--training.local_batch_size",
        "1",
        "--training.gradient_accumulation_steps",
        "2",
        "--activation_checkpoint.mode",
        "full",
        "--validation.enable",
        "true",
        "--validation.freq",
        "7",
        "--validation.steps",
        "2",
    )
    assert_loss_falls(s)
    assert_same_run(s, reference)
    assert byte_kinds(s) == {"broadcast", "reduce", "replicate_reduce", "replicate_broadcast"}
    for kind in byte_kinds(s):
        assert dmuon_total(s, f"bytes_{kind}") > 0, kind
    assert sorted(s["loss/validation"]) == [7, 14]


@pytest.mark.slow
def test_dp2_tp2_adamw_matches_single_process(tmp_path, reference_adamw) -> None:
    """FSDP2 x TP with AdamW (no DMuon): selective AC, grad accumulation through set_requires_gradient_sync."""
    s = train(
        4,
        tmp_path,
        "--optimizer.name",
        "adamw",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
        "--training.gradient_accumulation_steps",
        "2",
        "--activation_checkpoint.mode",
        "selective",
    )
    assert_loss_falls(s)
    assert_same_run(s, reference_adamw)
    assert not any(tag.startswith("dmuon/") for tag in s)


@pytest.mark.slow
def test_dp2_tp2_dmuon_matches_single_process(tmp_path, reference) -> None:
    s = train(4, tmp_path, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4")
    assert_loss_falls(s)
    assert_same_run(s, reference)
    assert byte_kinds(s) == {"broadcast", "reduce", "tp_gather", "tp_scatter"}  # no tp_gram without the option
    assert dmuon_total(s, "bytes_broadcast") > 0 and dmuon_total(s, "bytes_tp_gather") > 0


@pytest.mark.slow
def test_3d_2x2x2_dmuon_matches_single_process(tmp_path, reference) -> None:
    s = train(
        8,
        tmp_path,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
    )
    assert_loss_falls(s)
    assert_same_run(s, reference)
    for kind in ("broadcast", "reduce", "replicate_reduce", "replicate_broadcast", "tp_gather"):
        assert dmuon_total(s, f"bytes_{kind}") > 0, kind


@pytest.mark.slow
def test_compile_and_full_ac_single_process(tmp_path, reference) -> None:
    """Per-block torch.compile (of the checkpointed block bodies) under DMuon + FSDP2: same training. The max-logit
    metric measures inside the compiled, checkpointed attention (its recompute folds in the same values again) what
    an eager run without checkpointing measures."""
    measure = ("--metrics.log_max_logit", "true")
    s = train(
        1,
        tmp_path / "compiled",
        "--training.local_batch_size",
        "8",
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "full",
        *measure,
    )
    assert_same_run(s, reference, rtol=1e-3)  # inductor's fused kernels round differently
    eager = train(1, tmp_path / "eager", "--training.local_batch_size", "8", *measure)
    for tag in ("attn/max_logit/layers.0.attention", "attn/max_logit/layers.1.attention"):
        assert s[tag].keys() == eager[tag].keys() and len(eager[tag]) > 1
        assert all(abs(s[tag][k] - v) <= 1e-3 * abs(v) for k, v in eager[tag].items()), (s[tag], eager[tag])


@pytest.mark.slow
def test_divergence_stops_every_rank_with_nonzero_exit(tmp_path) -> None:
    proc = run_train(
        2,
        train_argv(
            tmp_path,
            "--training.local_batch_size",
            "2",
            "--optimizer.muon.lr",
            "1e30",
            "--optimizer.adamw.lr",
            "1e30",
        ),
    )
    assert proc.returncode != 0, tail(proc)
    out = proc.stdout + proc.stderr
    assert "training diverged at step" in out and "non-finite" in out, tail(proc)
    for rank in (0, 1):  # every rank stops (ERROR passes the other ranks' WARNING log level)
        assert any(line.startswith(f"[rank{rank}]") and "training diverged" in line for line in out.splitlines())
    # It stopped right away (logging every step, every step reads the divergence record): no loss of a diverged
    # step was logged.
    assert max(read_scalars(tmp_path / "tb")["loss/train"]) < 5


# ---------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "args,expected",
    [
        (["--training.stepz", "3"], ["training.stepz"]),
        (["--parallelism.tensor_parallel_degree", "2"], ["config error", "tensor_parallel_degree", "world size 1"]),
        (["--model.flavor", "hugemodel"], ["config error", "model.flavor", "hugemodel", "debugmodel, tinymodel"]),
        (["--model.name", "unknown"], ["config error", "model.name", "'unknown'", "llama3, qwen3, tiny_mlp"]),
        (["--optimizer.name", "sgd"], ["config error", "optimizer.name", "adamw, dmuon, muon_naive"]),
        (["--optimizer.muon_params", "^nothing$"], ["config error", "optimizer.muon_params"]),
    ],
    ids=[
        "unknown-flag",
        "degrees-vs-world-size",
        "unknown-flavor",
        "unknown-model",
        "unknown-optimizer",
        "empty-muon-params",
    ],
)
def test_config_errors_exit_nonzero_naming_the_key(tmp_path, args, expected) -> None:
    proc = run_train(1, train_argv(tmp_path, *args), timeout=120)
    assert proc.returncode == 2, tail(proc)
    for text in expected:
        assert text in proc.stderr, tail(proc)
    assert "Traceback" not in proc.stderr, tail(proc)


def test_config_file_error_names_file_and_key(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlocal_batch_sise = 2\n")
    proc = run_train(1, ["--config", str(bad)], timeout=120)
    assert proc.returncode == 2, tail(proc)
    assert "training.local_batch_sise" in proc.stderr and str(bad) in proc.stderr, tail(proc)
    assert "did you mean training.local_batch_size" in proc.stderr, tail(proc)
