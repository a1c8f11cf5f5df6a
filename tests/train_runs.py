"""train.py runs shared by the Trainer-level tests: the arguments of a tinymodel run (the Llama-3 tinymodel on the
debug config's embedded data, sequences of 32) and the reference tests' hyper-parameters, launching train.py as
users do (`python train.py` / torchrun), and reading a run back independently of the code under test: its
TensorBoard scalars (EventAccumulator), its checkpoints (DCP's own reader)."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = "train_configs/debug_model.toml"
TRAIN_STEPS = 20  # the steps of a `train` run


def tiny_train_argv(
    dump: str | Path,
    *extra: str,
    seed: int = 7,
    tensorboard: bool = False,
    heartbeat: bool = False,
    config: str = DEBUG_CONFIG,
) -> list[str]:
    """train.py's arguments for a tinymodel run writing to `dump`, then `extra` (which may override any). No
    TensorBoard and no heartbeat thread unless `tensorboard` / `heartbeat` (then the config's settings)."""
    argv = ["--config", config, "--model.flavor", "tinymodel", "--training.seq_len", "32", "--training.seed", str(seed)]
    # fp32 NS: runs agree to fp32 rounding (the default is bf16 on CUDA and on CPUs with native bf16)
    argv += ["--optimizer.muon.ns_dtype", "float32"]
    if not tensorboard:
        argv += ["--metrics.enable_tensorboard", "false"]
    if not heartbeat:
        argv += ["--comm.heartbeat_seconds", "0"]
    return [*argv, "--job.dump_folder", str(dump), *extra]


def train_argv(dump: str | Path, *extra: str) -> list[str]:
    """The arguments of a `train` run: TRAIN_STEPS steps, seed 42, metrics every step, 5 warmup steps,
    TensorBoard and the heartbeat on; then `extra`."""
    steps = ["--training.steps", str(TRAIN_STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5"]
    return tiny_train_argv(dump, *steps, *extra, seed=42, tensorboard=True, heartbeat=True)


def run_train(nproc: int, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py` (1 process) or torchrun's `--standalone --nproc_per_node` run of it, with torchrun's
    environment for each rank, forked by the test harness's server (tests/_dist.py `run_script`) instead of
    started cold (seconds of imports per rank). The timeout only bounds a hang."""
    from tests._dist import run_script

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_script(nproc, "train.py", argv, cwd=str(REPO), env=env, timeout=timeout)


def tail(proc: subprocess.CompletedProcess) -> str:
    """A finished run's exit code and the ends of its stdout and stderr, for an assertion message."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard events under `tb_dir`: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read by DCP's own reader in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    sd = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    return sd


def train(nproc: int, dump: Path, *args: str) -> dict[str, dict[int, float]]:
    """A `train_argv` run on `nproc` ranks that must succeed; its scalars."""
    proc = run_train(nproc, train_argv(dump, *args))
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


def losses(scalars) -> list[float]:
    """The training loss of each of a `train` run's TRAIN_STEPS steps."""
    loss = scalars["loss/train"]
    assert sorted(loss) == list(range(1, TRAIN_STEPS + 1))
    return [loss[s] for s in range(1, TRAIN_STEPS + 1)]


def assert_loss_falls(scalars) -> None:
    """The run trains: the mean of its last 3 losses is 10% below that of its first 3 (the tinymodel's 20 steps
    take it from 6.0 to 5.1, a ratio of 0.85; a run whose updates do nothing or go astray stays near 1 or climbs).
    The layouts' exact agreement is `assert_same_run`'s to check."""
    values = losses(scalars)
    first, last = sum(values[:3]) / 3, sum(values[-3:]) / 3
    assert all(math.isfinite(v) for v in values)
    assert last < 0.9 * first, f"loss did not fall: first 3 {values[:3]}, last 3 {values[-3:]}"


def assert_same_run(scalars, ref, rtol: float = 1e-4) -> None:
    """Losses (and grad norms, 10x looser: they are not averaged) equal to the reference run's, step by step."""
    for tag, tol in (("loss/train", rtol), ("grad_norm", 10 * rtol)):
        got, want = scalars[tag], ref[tag]
        assert sorted(got) == sorted(want)
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        assert worst <= tol, f"{tag}: max relative difference {worst:.3g} > {tol:g}"


# ---- the hyper-parameters of the reference tests (test_train_reference.py, test_resume_references.py) --------
# Every one passed to train.py explicitly, so the references do not depend on debug_model.toml's or the
# dataclasses' defaults.
MUON_PARAMS = r"^layers\.\d+\.(attention|feed_forward)\.\w+\.weight$"
HPARAMS = {
    "optimizer.name": "dmuon",
    "optimizer.muon.lr": 0.01,
    "optimizer.muon.momentum": 0.95,
    "optimizer.muon.nesterov": True,
    "optimizer.muon.weight_decay": 0.1,
    "optimizer.muon.ns_steps": 5,
    "optimizer.muon.ns_coefficients": "polar_express",
    "optimizer.muon.eps": 1e-7,
    "optimizer.muon.adjust_lr_fn": "match_rms_adamw",
    "optimizer.muon.ns_dtype": "float32",  # the reference's (the default is bf16 on CUDA and native-bf16 CPUs)
    "optimizer.adamw.lr": 3e-3,
    "optimizer.adamw.betas": (0.9, 0.95),
    "optimizer.adamw.eps": 1e-8,
    "optimizer.adamw.weight_decay": 0.01,
    "optimizer.muon_params": MUON_PARAMS,
    "lr_scheduler.warmup_steps": 3,
    "lr_scheduler.decay_ratio": 0.5,  # 3 warmup, 3 stable, 6 decay steps
    "lr_scheduler.decay_type": "linear",
    "lr_scheduler.min_lr_factor": 0.1,
    "training.steps": 12,
    "training.seed": 42,
    "training.seq_len": 32,
    "training.mixed_precision_param": "float32",
    "training.mixed_precision_reduce": "float32",
    "training.dataset": "stdlib",
    "model.name": "llama3",
    "model.flavor": "tinymodel",
    "model.tokenizer": "byte",
}


def flag(value) -> list[str]:
    """A hyper-parameter's value as train.py's command line takes it (bools lower-case, tuples spread)."""
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, tuple):
        return [str(v) for v in value]
    return [str(value)]
