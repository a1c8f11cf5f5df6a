"""Checkpoints through train.py (titan_dmuon/components/checkpoint/), on real gloo ranks.

Every run trains the `tinymodel` flavor 10 steps on one global batch of 8 x 32 tokens, saving every 5 steps.
A "straight" run per layout (10 steps, its step-5 checkpoint kept) is shared by the tests below through a
module-scoped fixture, so each resume costs one launch:

  exact resume    step-5 of a layout's straight run, resumed on the same layout for steps 6-10: the same losses
                  and grad norms (==) and a bitwise identical step-10 checkpoint (weights and optimizer state);
                  1 process, 1D FSDP x 4, HSDP 2x2 (async publish, async checkpoints), dp2 x tp2, DDP x 2
  cross-topology  the 4-rank 1D step-5 resumed on 2 ranks, HSDP 2x2, dp2 x tp2, 1 process (same global batch):
                  steps 6-10 equal the 4-rank run's within 1e-5 relative
  kill -9         a 4-rank run saving asynchronously every step, killed (the whole process group) mid-run, then
                  rerun: it resumes from the newest complete checkpoint, its losses equal the straight run's, and
                  keep_latest_k = 2 leaves exactly 2 complete checkpoints
  errors          a partial or truncated checkpoint saved without checksums.json (the checked ones:
                  test_checkpoint_damage.py), another model, another global batch, a load_step that does not exist,
                  a model-only checkpoint before the last step: exit 2 naming the folder, and no file of the
                  checkpoint folder changed
  initial load    initial_load_path from a DCP step folder (in full, and weights only) and from its Hugging Face
                  conversion
  memory          the per-rank RSS figures the 4-rank runs log around saving and loading

The references are read back independently of the code under test: losses from the TensorBoard events,
checkpoint tensors with DCP's own reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests._dist import run_script
from tests.train_runs import DEBUG_CONFIG, REPO, read_checkpoint, read_scalars, tail, tiny_train_argv

pytestmark = pytest.mark.slow

STEPS = 10


def _argv(dump: str | Path, *extra: str, config: str = DEBUG_CONFIG) -> list[str]:
    """Every run's arguments: STEPS steps, seed 42, metrics every step, 2 warmup steps, a checkpoint every 5
    steps, TensorBoard on, no heartbeat; then `extra`."""
    args = ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    return tiny_train_argv(dump, *args, *extra, seed=42, tensorboard=True, config=config)


def _layout(nproc: int, local_batch: int, *args: str) -> tuple[int, list[str]]:
    assert local_batch * nproc >= 8
    return nproc, ["--training.local_batch_size", str(local_batch), *args]


# Global batch 8 rows everywhere: local batch x DP ranks.
LAYOUTS = {
    "1proc": _layout(1, 8),
    "fsdp4": _layout(4, 2),
    "fsdp2": _layout(2, 4),
    "hsdp2x2": _layout(
        4,
        2,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--optimizer.dmuon.replicate_async",
        "true",
        "--checkpoint.async_mode",
        "async",
    ),
    "dp2tp2": _layout(4, 4, "--parallelism.tensor_parallel_degree", "2"),
    "ddp2": _layout(
        2, 4, "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"
    ),
}


def _command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "train.py"]


def _env() -> dict[str, str]:
    # DEBUG: the machine-readable checkpoint memory records (`memory_rows`) beside the readable lines
    return {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_DMUON_LOG_LEVEL": "DEBUG"}


def launch(layout: str, dump: Path, *args: str, tb: str = "tb", timeout: float = 300) -> subprocess.CompletedProcess:
    nproc, layout_args = LAYOUTS[layout]
    argv = _argv(dump, *layout_args, "--metrics.save_tb_folder", tb, *args)
    return run_script(nproc, "train.py", argv, cwd=str(REPO), env=_env(), timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, tail(proc)
    return proc


def checkpoints(dump: Path) -> list[str]:
    """The complete checkpoints in a run's checkpoint folder (renamed, with DCP's .metadata)."""
    folder = dump / "checkpoint"
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / ".metadata").is_file())


def resume_from(source: Path, step: int, dump: Path) -> None:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")


def memory_rows(proc: subprocess.CompletedProcess) -> list[dict]:
    """The JSON record of each save and load (logged at DEBUG: `_env` asks for it)."""
    marker = "checkpoint memory: "
    text = proc.stdout + proc.stderr
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]


def assert_same_steps(got, want, steps, rtol: float) -> None:
    for tag in ("loss/train", "grad_norm"):
        assert sorted(got[tag]) == list(steps), f"{tag}: steps {sorted(got[tag])}"
        for s in steps:
            if rtol == 0:
                assert got[tag][s] == want[tag][s], f"{tag} at step {s}: {got[tag][s]!r} != {want[tag][s]!r}"
            else:
                rel = abs(got[tag][s] - want[tag][s]) / abs(want[tag][s])
                assert rel <= rtol, f"{tag} at step {s}: {got[tag][s]} vs {want[tag][s]} (relative {rel:.3g})"


class Runs:
    """The straight runs, launched on first use and shared by the module's tests."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def straight(self, layout: str) -> Path:
        dump = self.root / f"straight-{layout}"
        if layout not in self.procs:
            self.procs[layout] = _ok(launch(layout, dump))
            assert checkpoints(dump) == ["step-10", "step-5"]
        return dump


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("layout", ["1proc", "fsdp4", "hsdp2x2", "dp2tp2", "ddp2"])
def test_exact_resume(runs, layout, tmp_path):
    """10 steps straight vs 5 + stop + resume + 5 on the same layout: identical losses and final state, bitwise."""
    straight = runs.straight(layout)
    resume_from(straight, 5, tmp_path)
    proc = _ok(launch(layout, tmp_path))
    assert "Resumed at step 5" in proc.stdout + proc.stderr
    assert_same_steps(read_scalars(tmp_path / "tb"), read_scalars(straight / "tb"), range(6, STEPS + 1), rtol=0)
    want, got = (
        read_checkpoint(straight / "checkpoint" / "step-10"),
        read_checkpoint(tmp_path / "checkpoint" / "step-10"),
    )
    assert sorted(got) == sorted(want)
    assert any(k.startswith("model.") for k in got) and any(k.startswith("optimizer.state.") for k in got)
    for key in want:
        if key == "train_state.elapsed_s":  # wall time: it continues from the step-5 checkpoint's
            assert got[key].item() >= read_checkpoint(tmp_path / "checkpoint" / "step-5")[key].item() > 0
        elif key.startswith(("model.", "optimizer.", "lr_scheduler.", "dataloader.", "train_state.")):
            assert torch.equal(got[key], want[key]), f"{key} differs after the resume"
    if layout == "fsdp4":
        runs.procs["fsdp4-resumed"] = proc


@pytest.mark.parametrize("layout", ["fsdp2", "hsdp2x2", "dp2tp2", "1proc"])
def test_cross_topology_resume(runs, layout, tmp_path):
    """The 4-rank 1D FSDP step-5 checkpoint resumed on another layout with the same global batch."""
    source = runs.straight("fsdp4")
    resume_from(source, 5, tmp_path)
    _ok(launch(layout, tmp_path))
    assert_same_steps(read_scalars(tmp_path / "tb"), read_scalars(source / "tb"), range(6, STEPS + 1), rtol=1e-5)


def test_kill_during_async_save_resumes_from_the_newest_complete(runs, tmp_path):
    """kill -9 of every process of a 4-rank job that saves asynchronously every step, then the same command again."""
    straight = runs.straight("fsdp4")
    nproc, layout_args = LAYOUTS["fsdp4"]
    args = ["--checkpoint.interval", "1", "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2"]
    argv = _argv(tmp_path, *layout_args, *args)
    job = subprocess.Popen(
        _command(nproc) + argv + ["--metrics.save_tb_folder", "tb-killed"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    folder = tmp_path / "checkpoint"
    try:
        deadline = time.monotonic() + 240
        while job.poll() is None and time.monotonic() < deadline:
            if folder.is_dir() and any(int(n.split("-")[1]) >= 3 for n in checkpoints(tmp_path)):
                break
            time.sleep(0.02)
        assert job.poll() is None, "the job ended before it could be killed mid-run"
    finally:
        _kill_tree(job)
    survivors = checkpoints(tmp_path)
    newest = max(int(n.split("-")[1]) for n in survivors)
    assert 3 <= newest < STEPS
    # keep_latest_k=2, pruned only once the new step is in place: a kill between that rename and the prune leaves
    # three, never more, and always the newest consecutive ones (never an older one kept over a newer)
    steps = sorted(int(n.split("-")[1]) for n in survivors)
    assert 2 <= len(steps) <= 3 and steps == list(range(newest - len(steps) + 1, newest + 1)), survivors
    for name in survivors:  # every committed checkpoint is whole
        assert read_checkpoint(folder / name)["train_state.step"].item() == int(name.split("-")[1])
    # the same command again (its ranks forked by the test harness: what is tested is the folder it finds)
    rerun = argv + ["--metrics.save_tb_folder", "tb-rerun"]
    proc = _ok(run_script(nproc, "train.py", rerun, cwd=str(REPO), env=_env()))
    assert f"Resumed at step {newest}" in proc.stdout + proc.stderr
    assert_same_steps(
        read_scalars(tmp_path / "tb-rerun"), read_scalars(straight / "tb"), range(newest + 1, STEPS + 1), rtol=0
    )
    assert checkpoints(tmp_path) == [f"step-{STEPS}", f"step-{STEPS - 1}"]
    assert [p.name for p in folder.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name] == []


def scalar_events(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) TensorBoard shows per tag, in order: duplicates kept (read_scalars' dicts hide them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _with_elapsed(src: Path, dst: Path, elapsed_s: float) -> None:
    """src (a full checkpoint) as dst, but for its train_state.elapsed_s, rewritten through a torch.save file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(src, dst.parent / "whole.pt")
    sd = torch.load(dst.parent / "whole.pt", weights_only=False)
    sd["train_state"]["elapsed_s"] = torch.tensor(elapsed_s, dtype=torch.float64)
    torch.save(sd, dst.parent / "whole.pt")
    torch_save_to_dcp(dst.parent / "whole.pt", dst)
    (dst.parent / "whole.pt").unlink()
    shutil.copy(src / "config.toml", dst / "config.toml")


def test_rerun_in_the_same_folder_logs_each_step_once_and_elapsed_time_goes_on(runs, tmp_path):
    """The 1-process straight run as if killed after logging steps 6-10 whose checkpoint never completed (its
    TensorBoard folder and only its step-5 checkpoint, saved after 1 h of training), rerun in that folder for 12
    steps (another lr schedule from step 6): TensorBoard shows each step 1-12 once, steps 1-5 with the first run's
    values and 6-12 with the rerun's; the elapsed time goes on from the checkpoint's hour, in TensorBoard, on the
    console and in the rerun's checkpoints."""
    straight = runs.straight("1proc")
    dump = tmp_path / "run"
    shutil.copytree(straight / "tb", dump / "tb")
    (dump / "checkpoint").mkdir()
    _with_elapsed(straight / "checkpoint" / "step-5", dump / "checkpoint" / "step-5", 3600.0)
    out = _ok(launch("1proc", dump, "--training.steps", "12"))
    text = out.stdout + out.stderr
    assert "Resumed at step 5" in text

    events, first = scalar_events(dump / "tb"), read_scalars(straight / "tb")
    for tag in ("loss/train", "lr/muon", "progress/elapsed_s", "throughput/tokens_per_sec_global"):
        assert [step for step, _ in events[tag]] == list(range(1, 13)), f"{tag}: {events[tag]}"
    lr = dict(events["lr/muon"])
    assert all(lr[s] == first["lr/muon"][s] for s in range(1, 6))
    console_lr = {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)/12\s.*?lr_muon: (\S+)", text)}
    assert sorted(console_lr) == list(range(6, 13))
    for s in range(6, 11):  # the rerun's 12-step schedule (3 digits on the console), not the first run's 10-step one
        assert abs(lr[s] - console_lr[s]) <= 0.01 * lr[s] < 0.1 * abs(lr[s] - first["lr/muon"][s]), s

    elapsed = [value for _, value in events["progress/elapsed_s"]]
    assert elapsed[:5] == [first["progress/elapsed_s"][s] for s in range(1, 6)] and elapsed[4] < 60
    assert 3600 <= elapsed[5] <= elapsed[-1] < 3600 + 300 and elapsed == sorted(elapsed)
    assert re.search(r"step:\s+6/12\s.*elapsed: 1:0\d:\d\d", text), text[-3000:]
    assert checkpoints(dump) == ["step-10", "step-12"]
    saved = read_checkpoint(dump / "checkpoint" / "step-12")["train_state.elapsed_s"].item()
    assert elapsed[-1] <= saved < 3600 + 300


def _descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


def _kill_tree(job: subprocess.Popen) -> None:
    """kill -9 of the job: torchrun and every rank at once (torchrun starts each rank in a session of its own, so
    a process-group kill would miss them)."""
    pids = [job.pid, *_descendants(job.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()
    for pid in pids[1:]:  # no rank outlives the kill (and writes on while the test looks)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _model_only_copy(src: Path, dst: Path) -> None:
    """src's weights and train state alone (no optimizer, schedule or data position) as dst, saved by DCP."""
    sd = {k: v for k, v in read_checkpoint(src).items() if k.startswith(("model.", "train_state."))}
    dcp.save(sd, checkpoint_id=dst, no_dist=True)
    shutil.copy(src / "config.toml", dst / "config.toml")


def _break_data_file(step: Path) -> None:
    (data,) = [p for p in step.iterdir() if p.suffix == ".distcp" and p.stat().st_size > 0][:1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


@pytest.mark.parametrize(
    ("case", "args", "match"),
    [
        ("partial", [], r"step-10 is partial or corrupted"),  # both as saved before checksums.json was kept
        ("truncated", [], r"step-10 could not be read"),  # (test_checkpoint_damage.py: the checked steps)
        ("other_model", ["--model.flavor", "debugmodel"], r"another model config: model.flavor = 'tinymodel' there"),
        ("other_batch", ["--training.local_batch_size", "4"], r"does not match this run: shape differences"),
        ("missing_step", ["--checkpoint.load_step", "7"], r"has no step-7 \(complete checkpoints: \[5, 10\]\)"),
        ("model_only", [], r"step-7 holds model weights only .* cannot continue from it to step 10"),
    ],
)
def test_bad_checkpoint_exits_2_and_changes_nothing(runs, tmp_path, case, args, match):
    source = runs.straight("fsdp4")
    shutil.copytree(source / "checkpoint", tmp_path / "checkpoint")
    if case == "partial":
        (tmp_path / "checkpoint" / "step-10" / ".metadata").unlink()
        (tmp_path / "checkpoint" / "step-10" / "checksums.json").unlink()
    elif case == "truncated":
        _break_data_file(tmp_path / "checkpoint" / "step-10")
        (tmp_path / "checkpoint" / "step-10" / "checksums.json").unlink()
    elif case == "model_only":  # what last_save_model_only writes, at a step before training.steps
        _model_only_copy(tmp_path / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-7")
        shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    before = _fingerprint(tmp_path / "checkpoint")
    proc = launch("1proc", tmp_path, *args)
    assert proc.returncode == 2, tail(proc)
    assert str(tmp_path / "checkpoint") in proc.stderr
    assert re.search(match, proc.stderr), proc.stderr[-3000:]
    assert _fingerprint(tmp_path / "checkpoint") == before


def test_memory_while_saving_and_loading_on_4_ranks(runs):
    """The per-rank RSS figures logged around a save (straight 4-rank run) and a load (its resume): every rank
    reports, and the peak grows by no more than this rank's state share plus a fixed allowance (DCP's plans,
    buffers and the allocator's granularity on a model of a few hundred KiB)."""
    runs.straight("fsdp4")
    if "fsdp4-resumed" not in runs.procs:
        pytest.skip("needs test_exact_resume[fsdp4] in the same session")
    procs = [runs.procs["fsdp4"], runs.procs["fsdp4-resumed"]]
    rows = [r for proc in procs for r in memory_rows(proc)]
    text = "".join(proc.stdout + proc.stderr for proc in procs)
    for what in ("save", "load"):
        mine = [r for r in rows if r["what"] == what]  # one line per save or load, for the whole job
        assert mine and all(r["ranks"] == 4 for r in mine), (what, mine)
        readable = re.findall(rf"checkpoint {what} of step (\d+) \(4 ranks\): peak memory \+", text)
        assert sorted(map(int, readable)) == sorted(r["step"] for r in mine), (what, readable)
        for r in mine:
            print(
                f"{what} step {r['step']}: RSS {r['rss_before_mib']} MiB before, peak {r['peak_after_mib']} MiB "
                f"after (+{r['peak_growth_mib']}), state share {r['state_share_mib']} MiB (min, median, max)"
            )
            assert r["growth_beyond_share_mib"]["max"] <= 32, r


def test_initial_load_path(runs, tmp_path):
    """checkpoint.initial_load_path into an empty checkpoint folder: a DCP step folder in full continues like a
    resume; its model weights alone, and the same weights converted to a Hugging Face folder, start two runs
    that are the same run (a fresh optimizer and schedule from step 1 on the trained weights)."""
    straight = runs.straight("1proc")
    step5 = straight / "checkpoint" / "step-5"
    full = tmp_path / "full"
    _ok(
        launch(
            "1proc", full, "--checkpoint.initial_load_path", str(step5), "--checkpoint.initial_load_model_only", "false"
        )
    )
    assert_same_steps(read_scalars(full / "tb"), read_scalars(straight / "tb"), range(6, STEPS + 1), rtol=0)

    weights = read_scalars(
        _ok_dump(launch("1proc", tmp_path / "weights", "--checkpoint.initial_load_path", str(step5)))
    )
    fresh = read_scalars(straight / "tb")
    assert weights["loss/train"][1] < fresh["loss/train"][1] - 0.1  # trained weights, not the seeded init

    pytest.importorskip("safetensors")
    script = REPO / "scripts" / "convert_checkpoint.py"
    if not script.is_file():
        pytest.skip("scripts/convert_checkpoint.py is not there")
    hf = tmp_path / "hf"
    _ok(
        subprocess.run(
            [sys.executable, str(script), str(step5), str(hf)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert list(hf.glob("*.safetensors"))
    from_hf = read_scalars(_ok_dump(launch("1proc", tmp_path / "from_hf", "--checkpoint.initial_load_path", str(hf))))
    assert_same_steps(from_hf, weights, range(1, STEPS + 1), rtol=0)


def _ok_dump(proc: subprocess.CompletedProcess) -> Path:
    """The TensorBoard folder of a successful launch."""
    _ok(proc)
    return Path(proc.args[proc.args.index("--job.dump_folder") + 1]) / "tb"


def test_relative_dump_folder_with_another_cwd_per_rank(tmp_path):
    """2 ranks, each started in a directory of its own, with a relative job.dump_folder: the folder is rank 0's
    (resolved there and broadcast), so the checkpoint is whole (both ranks' files, loadable) and no rank writes
    anything under its own directory."""
    wrapper = tmp_path / "rank_cwd.sh"
    wrapper.write_text(f'#!/bin/bash\ncd {tmp_path}/n$RANK && exec {sys.executable} {REPO / "train.py"} "$@"\n')
    wrapper.chmod(0o755)
    for rank in (0, 1):
        (tmp_path / f"n{rank}").mkdir()
    nproc, layout_args = LAYOUTS["fsdp2"]
    argv = _argv("dump", *layout_args, config=str(REPO / DEBUG_CONFIG))
    argv += ["--training.steps", "2", "--checkpoint.interval", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    _ok(
        subprocess.run(
            [*torchrun, "--no-python", str(wrapper), *argv],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert checkpoints(tmp_path / "n0" / "dump") == ["step-2"]
    step2 = tmp_path / "n0" / "dump" / "checkpoint" / "step-2"
    assert sorted(p.name for p in step2.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert read_checkpoint(step2)["train_state.step"].item() == 2
    assert not (tmp_path / "n1" / "dump" / "checkpoint").exists()
