"""No host sync in a training step outside the steps that read (titan_dmuon/trainer.py `read_due`), counted on CPU.

The Trainer itself (`Trainer.train`, in process on real gloo ranks) trains the Llama-3 debug model (dense) for
STEPS steps with metrics every LOG_FREQ steps, under `tests/host_syncs.py`'s counter of the Tensor methods that read
a value to the host (`item`, `tolist`, `if t:`, `float(t)`, `int(t)`, `cpu`, `numpy`, ...), each charged to the
titan_dmuon file that made it. On the steps that log nothing the trainer and its components make no such call (the
loss, the grad norm, the divergence record and the stop flag stay on the device); the steps that log read once
(the counter's self-check). A divergence at a step that reads nothing raises `TrainingDivergedError` naming that
step at the next read, before any checkpoint of it; a stop signal is acted on at the next read step.
"""

from __future__ import annotations

import signal

import pytest

from tests._dist import run_distributed

STEPS, LOG_FREQ = 7, 4
LOG_STEPS = [1, 4, 7]  # step 1, every LOG_FREQ steps, the last: the steps that read
QUIET_STEPS = [s for s in range(1, STEPS + 1) if s not in LOG_STEPS]
pytestmark = pytest.mark.slow


def _argv(dump: str, *extra: str) -> list[str]:
    argv = ["--config", "train_configs/debug_model.toml", "--training.steps", str(STEPS)]
    argv += ["--metrics.log_freq", str(LOG_FREQ), "--metrics.enable_tensorboard", "false"]
    argv += ["--training.local_batch_size", "2", "--training.seq_len", "64", "--comm.heartbeat_seconds", "0"]
    return [*argv, "--job.dump_folder", dump, *extra]


def _counted_run(rank: int, world: int, dump: str, extra: tuple[str, ...]) -> list:
    from tests.host_syncs import HostSyncCounter
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import READ_EVERY, Trainer

    assert STEPS < READ_EVERY  # no read of the stop flag between the log steps
    trainer = Trainer(parse_args(_argv(f"{dump}/r{rank}", *extra)))
    try:
        with HostSyncCounter(step=lambda: trainer.step) as syncs:
            trainer.train()
        assert trainer.step == STEPS
        return syncs.syncs
    finally:
        trainer.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def dmuon_syncs(request, tmp_path_factory) -> list:
    """Every rank's counted calls of a DMuon run on 1 and on 2 gloo ranks (FSDP2 + DMuon's owners)."""
    dump = tmp_path_factory.mktemp("syncs")
    return run_distributed(_counted_run, request.param, str(dump), ())


def _per_step(syncs: list, owners: set[str]) -> dict:
    out: dict = {}
    for s in syncs:
        if s.owner in owners:
            out[s.step] = out.get(s.step, 0) + 1
    return out


def test_the_trainer_makes_no_host_sync_on_steps_that_do_not_log(dmuon_syncs) -> None:
    from tests.host_syncs import describe

    for rank, syncs in enumerate(dmuon_syncs):
        quiet = [s for s in syncs if s.owner == "framework" and s.step in QUIET_STEPS]
        assert not quiet, f"rank {rank}: the trainer read to the host on a step that logs nothing:\n{describe(quiet)}"
        # The counter sees the trainer's one read of each log step (and whatever logging reads there).
        per_step = _per_step(syncs, {"framework"})
        assert all(per_step.get(s, 0) >= 1 for s in LOG_STEPS), (rank, per_step)
        reads = [s for s in syncs if s.where.startswith("trainer.py") and s.method == "tolist" and "_read" in s.where]
        assert sorted(s.step for s in reads) == LOG_STEPS, describe(reads)


def test_a_whole_step_trainer_and_dmuon_makes_no_host_sync_on_steps_that_do_not_log(dmuon_syncs) -> None:
    # THE WHOLE STEP: the trainer AND the optimizer library (titan_dmuon/dmuon/: Muon.step, its backward hooks, its
    # clip), charged "dmuon" by the counter. dmuon.Muon's has-grad bookkeeping stays on the device (it once read the
    # has-grad fractions every step in `_settle_owned_grads`).
    from tests.host_syncs import describe

    for rank, syncs in enumerate(dmuon_syncs):
        quiet = [s for s in syncs if s.owner in ("framework", "dmuon") and s.step in QUIET_STEPS]
        assert not quiet, f"rank {rank}: a host read on a step that logs nothing:\n{describe(quiet)}"


@pytest.mark.parametrize("optimizer", ["adamw", "muon_naive"])
def test_the_other_optimizer_components_make_no_host_sync_on_steps_that_do_not_log(tmp_path, optimizer) -> None:
    from tests.host_syncs import describe

    (syncs,) = run_distributed(_counted_run, 1, str(tmp_path), ("--optimizer.name", optimizer))
    quiet = [s for s in syncs if s.owner in ("framework", "dmuon") and s.step in QUIET_STEPS]
    assert not quiet, f"{optimizer}: a host read on a step that logs nothing:\n{describe(quiet)}"


# ---- divergence and stop signals, read late --------------------------------------------------------------------
BAD_STEP = 5  # reads nothing: not 1, not a multiple of LOG_FREQ or of the checkpoint interval 3
DIVERGED_STEPS, INTERVAL = 9, 3  # checkpoints at 3, 6, 9: the read at 6 (before its save) finds step 5


def _diverging_run(rank: int, world: int, dump: str, what: str) -> dict:
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer, TrainingDivergedError

    extra = ["--training.steps", str(DIVERGED_STEPS), "--checkpoint.enable", "true"]
    extra += ["--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "0"]
    trainer = Trainer(parse_args(_argv(dump, *extra)))
    logged: list[int] = []
    try:
        log = trainer.metrics.log
        trainer.metrics.log = lambda step, scalars: (logged.append(step), log(step, scalars))[1]
        if what == "loss":  # this step's loss on this rank only: the all-reduced loss is NaN on every rank
            loss_fn = trainer._loss

            def poisoned_loss(inputs, labels):
                loss = loss_fn(inputs, labels)
                return loss * float("nan") if trainer.step == BAD_STEP and rank == world - 1 else loss

            trainer._loss = poisoned_loss
        else:  # the grad norm only (the loss stays finite at that step)
            clip = trainer.optimizer_component.clip_grad_norm_

            def poisoned_norm(max_norm):
                norm = clip(max_norm)
                return norm * float("inf") if trainer.step == BAD_STEP else norm

            trainer.optimizer_component.clip_grad_norm_ = poisoned_norm
        with pytest.raises(TrainingDivergedError) as err:
            trainer.train()
        folder = trainer.checkpointer.folder
        return {
            "error": str(err.value),
            "step": trainer.step,
            "logged": logged,
            "saved": sorted(p.name for p in folder.iterdir()) if folder.exists() else [],
        }
    finally:
        trainer.close()


@pytest.mark.parametrize("what", ["loss", "grad norm"])
def test_a_divergence_between_reads_raises_naming_its_step_and_saves_nothing_of_it(tmp_path, what) -> None:
    """A NaN loss (one rank's) or an inf grad norm at step 5, a step that reads nothing: every rank raises at the
    next read, step 6, naming step 5 and its values, before step 6's checkpoint; the checkpoint of step 3 (healthy)
    is the only one, and nothing of steps 5 or 6 was logged."""
    for rank, r in enumerate(run_distributed(_diverging_run, 2, str(tmp_path), what)):
        assert r["step"] == 6, (rank, r)
        assert f"training diverged at step {BAD_STEP}: " in r["error"] and "non-finite" in r["error"], r["error"]
        assert "read after step 6" in r["error"], r["error"]
        bad = "loss = nan" if what == "loss" else "grad norm = inf"
        assert bad in r["error"], r["error"]
        assert r["saved"] == ["step-3"], (rank, r["saved"])
        assert r["logged"] == [1, 4], (rank, r["logged"])


def _stopped_run(rank: int, world: int, dump: str, signal_step: int, log_freq: int) -> dict:
    from titan_dmuon.config import parse_args
    from titan_dmuon.parallel.preemption import StopRequested
    from titan_dmuon.trainer import Trainer

    extra = ["--training.steps", "15", "--metrics.log_freq", str(log_freq)]
    trainer = Trainer(parse_args(_argv(dump, *extra)))
    try:
        step_fn = trainer.train_step

        def signalled_step(data_iter):  # the signal lands on rank 0 only, as its step begins
            if rank == 0 and trainer.step == signal_step:
                trainer.stop_signals.received = signal.SIGTERM
            return step_fn(data_iter)

        trainer.train_step = signalled_step
        with pytest.raises(StopRequested) as stop:
            trainer.train()
        return {"step": stop.value.step, "signum": stop.value.signum}
    finally:
        trainer.close()


@pytest.mark.parametrize("log_freq,stopped", [(1, 3), (100, 10)], ids=["log-every-step", "log-every-100"])
def test_a_stop_signal_is_agreed_at_the_next_read_step(tmp_path, log_freq, stopped) -> None:
    """SIGTERM on rank 0 at step 3: logging every step, both ranks stop after step 3; logging every 100 steps, at the
    next read, step 10 (READ_EVERY): the lag is at most READ_EVERY - 1 steps."""
    from titan_dmuon.trainer import READ_EVERY

    assert READ_EVERY == 10
    results = run_distributed(_stopped_run, 2, str(tmp_path), 3, log_freq)
    assert results == [{"step": stopped, "signum": signal.SIGTERM}] * 2
