"""Pipeline parallelism end to end: train.py on 4 gloo ranks with a pipeline axis against the single process.

Every run trains the Llama-3 tinymodel (2 blocks) for 8 steps on the same global batch of 8 x 32 tokens with fp32
Newton-Schulz, so each layout's losses are the single process's to fp32 rounding: the pipeline splits a step's
rows into microbatches (each a mean over its tokens divided by their number), and the single process takes the
mean over the same rows. The reference is train.py without any pipeline, 1 process: none of the pipeline code
runs there.

  pp2 x fsdp2 (GPipe, 1F1B, DMuon Z3 and Z2), pp2 x tp2 (1F1B), pp4 (1F1B: 4 stages of one unit, the first
  (embedding) and the last (norm + head) without any Muon matrix), pp2 x fsdp2 with 2 stages per rank on each
  multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); Z2's
  broadcast bytes independent of the microbatch count; dmuon == muon_naive under pp2; an explicit split whose
  first stage has no Muon matrix; the Qwen3 MoE model under pp2 x ep2 against its single process (losses, aux loss,
  every layer's load); DeepSeek-V3 on pp2 with a stage that has no MoE layer, also under pp2 x ep2 x tp2 (8
  ranks) and in the dry-run planner under pp2 x ep2; checkpoints across pipeline degrees (bitwise on pp2);
  validation, AC, accumulation, the Hugging Face export and generate.py under pp2; a stop signal on one stage; the
  configuration errors.
"""

from __future__ import annotations

import pytest

from tests.train_runs import assert_same_run, read_scalars, run_train, tail, tiny_train_argv

STEPS = 8


def _argv(dump, *extra: str) -> list[str]:
    steps = ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
    return tiny_train_argv(dump, *steps, *extra, seed=42, tensorboard=True)


def _train(nproc: int, dump, *extra: str) -> dict[str, dict[int, float]]:
    proc = run_train(nproc, _argv(dump, *extra))
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


def _pp(degree: int, schedule: str, *extra: str) -> tuple[str, ...]:
    return (
        "--parallelism.pipeline_parallel_degree",
        str(degree),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        *extra,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no pipeline: the losses every layout must give."""
    return _train(1, tmp_path_factory.mktemp("ref"))


FSDP2 = ("--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4")

LAYOUTS = {
    "pp2_fsdp2_1F1B": _pp(2, "1F1B", *FSDP2),
    "pp2_fsdp2_GPipe": _pp(2, "GPipe", *FSDP2),
    "pp2_tp2_1F1B": _pp(2, "1F1B", "--parallelism.tensor_parallel_degree", "2"),
    "pp2_hsdp2x1_1F1B": _pp(
        2,
        "1F1B",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.local_batch_size",
        "4",
    ),
    "pp4_1F1B": _pp(4, "1F1B"),
    "pp2_fsdp2_1F1B_dmuon_Z2": _pp(2, "1F1B", *FSDP2, "--optimizer.dmuon.reshard_after_forward", "false"),
    **{
        f"pp2_fsdp2_{s}": _pp(2, s, *FSDP2)
        for s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    },
}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=() if k == "pp2_fsdp2_1F1B" else pytest.mark.slow) for k in LAYOUTS]
)
def test_pipeline_matches_single_process(tmp_path, reference, layout) -> None:
    scalars = _train(4, tmp_path, *LAYOUTS[layout])
    assert_same_run(scalars, reference, rtol=1e-5)


@pytest.mark.slow
def test_qwen3_dualpipev_matches_single_process(tmp_path) -> None:
    """The Qwen3 tinymodel (q/k norms, tied embedding: DualPipeV puts the first and the last stage on pp rank 0) on
    pp2 x fsdp2 against its single process."""
    qwen3 = ("--model.name", "qwen3")
    want = _train(1, tmp_path / "one", *qwen3)
    assert_same_run(_train(4, tmp_path / "pp", *qwen3, *_pp(2, "DualPipeV", *FSDP2)), want, rtol=1e-5)


@pytest.mark.slow
def test_dmuon_z2_broadcasts_once_per_step_whatever_the_microbatches(tmp_path) -> None:
    """Under a pipeline DMuon keeps each group's broadcast buffer for the whole step (Z2): 4 microbatches of one row
    broadcast the bytes 2 microbatches of 2 rows do, one packed broadcast per group and step (per microbatch, the
    4 would broadcast twice the 2's)."""
    z2 = _pp(2, "1F1B", *FSDP2, "--optimizer.dmuon.reshard_after_forward", "false")
    four = _train(4, tmp_path / "four", *z2)
    one = _train(4, tmp_path / "two", *z2, "--parallelism.pipeline_parallel_microbatch_size", "2")
    got, want = four["dmuon/bytes_broadcast"], one["dmuon/bytes_broadcast"]
    assert got == want and min(want.values()) > 0


@pytest.mark.slow
def test_dmuon_equals_muon_naive_under_pp2(tmp_path) -> None:
    """The same pipeline with Muon the naive way (FSDP2 gathers every grad, every rank runs NS): DMuon's
    stage-local owners change nothing of the update."""
    layout = _pp(2, "1F1B", *FSDP2)
    dmuon = _train(4, tmp_path / "dmuon", *layout)
    naive = _train(4, tmp_path / "naive", *layout, "--optimizer.name", "muon_naive")
    assert_same_run(naive, dmuon, rtol=1e-5)


@pytest.mark.slow
def test_qk_clip_pp2_matches_single_process(tmp_path) -> None:
    """QK-clip under a pipeline (the Llama tinymodel, multi-head: wq and wk rows each take sqrt(gamma)): each stage
    measures its own layers, one all-reduce over every rank gives each rank the whole model's grid, and each stage's
    owners clip their own matrices. Losses, every layer's logged max logit and the clipped heads equal the single
    process's (whose clip tests/distributed/test_qk_clip_layouts.py checks against a reference)."""
    clip = ("--optimizer.muon.qk_clip_tau", "0.05")
    want = _train(1, tmp_path / "one", *clip)
    got = _train(4, tmp_path / "pp", *clip, *_pp(2, "1F1B", *FSDP2))
    assert_same_run(got, want, rtol=1e-5)
    assert sum(v > 0 for v in want["attn/clipped_heads"].values()) >= STEPS // 2
    for tag in ("attn/max_logit/layers.0.attention", "attn/max_logit/layers.1.attention", "attn/clipped_heads"):
        assert got[tag].keys() == want[tag].keys()
        assert all(abs(got[tag][s] - v) <= 1e-5 * abs(v) for s, v in want[tag].items()), tag


@pytest.mark.slow
def test_explicit_split_with_a_stage_without_muon_matrices(tmp_path, reference) -> None:
    """module_fqns_per_model_part: stage 0 holds the embedding only (no Muon matrix: AdamW alone on rank 0, which
    still takes part in DMuon's set-up and norm collectives), stage 1 the rest."""
    split = "tok_embeddings;layers.0,layers.1,norm,output"
    scalars = _train(2, tmp_path, *_pp(2, "1F1B", "--parallelism.module_fqns_per_model_part", split))
    assert_same_run(scalars, reference, rtol=1e-5)


MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe")
ONE_ROW_MICROBATCHES = ("--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "8")


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The Qwen3 MoE debug model on 1 process, its 8 rows a step as 8 micro-batches of one row: the microbatches a
    pipeline of 2 DP ranks with 4 one-row microbatches each runs (an MoE's auxiliary loss depends on the rows
    it is computed over, so the split must be the same)."""
    return _train(
        1,
        tmp_path_factory.mktemp("moe_ref"),
        *MOE,
        *ONE_ROW_MICROBATCHES,
    )


DEEPSEEK_V3 = ("--model.name", "deepseek_v3")


@pytest.fixture(scope="module")
def deepseek_v3_reference(tmp_path_factory):
    """The DeepSeek-V3 tinymodel on 1 process, one-row micro-batches (see `moe_reference`)."""
    return _train(1, tmp_path_factory.mktemp("deepseek_v3_ref"), *DEEPSEEK_V3, *ONE_ROW_MICROBATCHES)


def test_deepseek_v3_pp2_with_a_stage_without_moe_matches_single_process(tmp_path, deepseek_v3_reference) -> None:
    """DeepSeek-V3's dense first layer: on pp2 (1F1B) stage 0 holds the embedding and the dense layer 0, stage 1
    the MoE layer 1. The MoE step's all-reduce of the expert counts must still run on the stage without an MoE
    layer (it hung there once), and the losses, the aux loss and the layer count are the single process's with the
    same one-row microbatches."""
    model = DEEPSEEK_V3
    ref = deepseek_v3_reference
    scalars = _train(
        2, tmp_path / "pp", *model, *_pp(2, "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1")
    )
    assert_same_run(scalars, ref, rtol=1e-5)
    assert set(scalars["moe/layers"].values()) == {1.0}
    for step in range(1, STEPS + 1):
        assert abs(scalars["moe/aux_loss"][step] - ref["moe/aux_loss"][step]) <= 1e-5 * ref["moe/aux_loss"][step]


@pytest.mark.slow
def test_deepseek_v3_pp2_ep2_tp2_with_a_stage_without_experts_matches_single_process(
    tmp_path, deepseek_v3_reference
) -> None:
    """8 ranks, pp2 x (shard 2 = ep 2) x tp2: stage 0 (the dense layer 0) holds no expert while expert parallelism
    is on. That stage is no config error, and it builds DMuon's expert axes as the MoE stage does (a collective: it
    hung when only the MoE stage built them). Under TP the MLA down projections are DMuon matrices the plan leaves
    whole, an owner in each TP slice of a stage: the grad norm counts them once. Losses and grad norms of the
    single process."""
    extra = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2")
    extra += ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4")
    microbatches = ("--parallelism.pipeline_parallel_microbatch_size", "1")
    scalars = _train(8, tmp_path, *DEEPSEEK_V3, *_pp(2, "1F1B", *microbatches, *extra))
    assert_same_run(scalars, deepseek_v3_reference, rtol=1e-5)


def test_deepseek_v3_pp2_ep2_dry_run_plans_the_stage_without_experts(tmp_path) -> None:
    """The dry-run planner parallelizes each pp rank's part on its own (titan_dmuon/planner/plan.py): the part
    without an MoE layer under expert parallelism is planned, not a config error."""
    proc = run_train(
        1,
        _argv(
            tmp_path,
            *DEEPSEEK_V3,
            *_pp(
                2,
                "1F1B",
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--training.local_batch_size",
                "4",
                "--job.dry_run",
                "--job.dry_run_world_size",
                "4",
            ),
        ),
    )
    assert proc.returncode == 0, tail(proc)
    assert "Fits:" in proc.stdout + proc.stderr, tail(proc)


@pytest.mark.slow
def test_moe_pp2_ep2_matches_single_process_and_reports_every_layer(tmp_path, moe_reference) -> None:
    """Qwen3 MoE (tied embedding: a V schedule puts the first and the last stage on one rank) on pp2 x fsdp2 with
    the experts split over ep2: the losses of the single process, and the load metrics count all 4 layers of
    both stages (each rank holds 2)."""
    layout = _pp(2, "ZBVZeroBubble", *FSDP2, "--parallelism.expert_parallel_degree", "2")
    scalars = _train(4, tmp_path, *MOE, *layout)
    assert_same_run(scalars, moe_reference, rtol=1e-5)
    assert set(scalars["moe/layers"].values()) == {4.0}
    for step in range(1, STEPS + 1):
        assert scalars["moe/min_load"][step] <= 1 <= scalars["moe/max_load"][step]
        want = moe_reference["moe/aux_loss"][step]
        assert abs(scalars["moe/aux_loss"][step] - want) <= 1e-5 * want


# ------------------------------------------------------------------------------------------- checkpoints
CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "4")


def _resume(tmp_path, saved, name: str, nproc: int, *layout: str) -> dict[str, dict[int, float]]:
    """Steps 5..8 on `layout` from the step-4 checkpoint of the run in `saved` (copied: nothing saved changes)."""
    import shutil

    dump = tmp_path / name
    shutil.copytree(saved / "checkpoint", dump / "checkpoint")
    shutil.rmtree(dump / "checkpoint" / f"step-{STEPS}")  # resume from step 4
    return _train(nproc, dump, *layout, *CKPT)


def _tail_of(scalars) -> dict[str, dict[int, float]]:
    return {tag: {s: v for s, v in values.items() if s > 4} for tag, values in scalars.items()}


@pytest.mark.slow
def test_pp2_checkpoint_resumes_on_pp2_fsdp4_and_one_process(tmp_path, reference) -> None:
    """A pp2 x fsdp2 run saves at steps 4 and 8 (and trains as a straight pp2 run that never saves, bitwise); its
    step-4 checkpoint (keyed by the whole model's FQNs, each stage's ranks writing their modules) resumes bitwise
    on pp2, and within 1e-5 on 1D FSDP over 4 ranks and on one process. A 1D FSDP checkpoint resumes on pp2
    within 1e-5 of the single process."""
    pp2 = _pp(2, "1F1B", *FSDP2)
    fsdp4 = ("--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2")
    straight = _train(4, tmp_path / "straight", *pp2)
    saved = tmp_path / "saved"
    assert_same_run(_train(4, saved, *pp2, *CKPT), straight, rtol=0)
    assert (saved / "checkpoint" / "step-4").is_dir()
    want = _tail_of(straight)
    assert_same_run(_tail_of(_resume(tmp_path, saved, "on_pp2", 4, *pp2)), want, rtol=0)
    assert_same_run(_tail_of(_resume(tmp_path, saved, "on_fsdp4", 4, *fsdp4)), want, rtol=1e-5)
    assert_same_run(_tail_of(_resume(tmp_path, saved, "on_1proc", 1)), want, rtol=1e-5)
    from_fsdp = tmp_path / "fsdp4_saved"
    _train(4, from_fsdp, *fsdp4, *CKPT)
    assert_same_run(_tail_of(_resume(tmp_path, from_fsdp, "fsdp4_on_pp2", 4, *pp2)), _tail_of(reference), rtol=1e-5)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "nproc,args,expected",
    [
        (2, _pp(2, "1F1B", "--model.name", "qwen3"), "ties its embedding and output head"),
        (2, _pp(2, "1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "1"), "1F1B runs one stage per rank"),
        (
            2,
            _pp(2, "1F1B", "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;norm,output"),
            "no stage holds layers.1",
        ),
        (2, _pp(4, "1F1B"), "pipeline_parallel_degree (4) does not divide the world size 2"),
        (
            2,
            _pp(2, "1F1B", "--training.local_batch_size", "3", "--parallelism.pipeline_parallel_microbatch_size", "2"),
            "do not split into microbatches",
        ),
    ],
)
def test_pipeline_config_errors(tmp_path, nproc, args, expected) -> None:
    proc = run_train(nproc, _argv(tmp_path, *args))
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, tail(proc)


# ------------------------------------------------------------------------------ the trainer's other features
VALIDATION = ("--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2")
FEATURES = ("--activation_checkpoint.mode", "full", "--training.local_batch_size", "4")
ACCUM = ("--training.gradient_accumulation_steps", "2")


@pytest.mark.slow
def test_pp2_validation_ac_accumulation_and_export_generate(tmp_path) -> None:
    """pp2 on 2 ranks with validation, full activation checkpointing and 2 accumulation micro-batches (8
    microbatches of the pipeline a step): the training and validation losses of one process with the same settings,
    and the checkpoint it saves last generates (scripts/generate.py, from the DCP folder) the tokens transformers
    generates from the Hugging Face export the run wrote itself (checkpoint.last_save_in_hf)."""
    from tests.integration.test_generate import _generate_py, _transformers

    one = _train(1, tmp_path / "one", *VALIDATION, *FEATURES, *ACCUM)
    extra = ("--checkpoint.enable", "true", "--checkpoint.interval", "8", "--checkpoint.last_save_in_hf", "true")
    pp = _train(2, tmp_path / "pp", *VALIDATION, *FEATURES, *ACCUM, *_pp(2, "1F1B"), *extra)
    assert_same_run(pp, one, rtol=1e-5)
    got, want = pp["loss/validation"], one["loss/validation"]
    assert sorted(got) == [4, 8] and all(abs(got[s] - want[s]) <= 1e-5 * want[s] for s in want)
    step = tmp_path / "pp" / "checkpoint" / f"step-{STEPS}"
    hf = next((tmp_path / "pp" / "checkpoint").glob("*hf*"))
    _, tokens = _transformers(hf)
    assert _generate_py(step) == tokens


@pytest.mark.slow
def test_a_stop_signal_on_one_stage_stops_both_after_the_same_step(tmp_path) -> None:
    """SIGTERM on pp rank 1 alone as its step 3 begins: both stages stop after step 3 (the stop flag rides the
    step's all-reduce over every rank), save step-3 and report 143; the checkpoint then resumes on one process to the
    losses of a straight pp2 run that never stopped (within 1e-5)."""
    import os

    from tests._dist import run_script
    from tests.integration.test_preemption import _SIGNAL_ONE_RANK
    from tests.train_runs import REPO

    status = tmp_path / "status"
    status.mkdir()
    wrapper = tmp_path / "signal_one_rank.py"
    wrapper.write_text(_SIGNAL_ONE_RANK)
    layout = _pp(2, "1F1B")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SIGNAL_RANK": "1",
        "SIGNAL_STEP": "3",
        "TRAIN_PY": str(REPO / "train.py"),
        "TITAN_DMUON_STATUS_DIR": str(status),
    }
    argv = _argv(tmp_path / "run", *layout, "--checkpoint.enable", "true", "--checkpoint.interval", "100")
    proc = run_script(2, str(wrapper), argv, cwd=str(REPO), env=env, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text, text[-4000:]
    assert {p.name: p.read_text() for p in status.glob("rank-*")} == {"rank-0": "143\n\n", "rank-1": "143\n\n"}
    assert [p.name for p in (tmp_path / "run" / "checkpoint").iterdir()] == ["step-3"]
    straight = _train(2, tmp_path / "straight", *layout)
    resumed = _train(1, tmp_path / "run", "--checkpoint.enable", "true", "--checkpoint.interval", "100")
    tail_of = {tag: {s: v for s, v in values.items() if s > 3} for tag, values in straight.items()}
    assert_same_run({t: {s: v for s, v in resumed[t].items() if s > 3} for t in resumed}, tail_of, rtol=1e-5)
