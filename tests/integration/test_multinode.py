"""scripts/multinode_trainer.slurm, run for real on one machine: 2 "nodes" x 2 ranks under stand-ins for srun and
scontrol (tests/integration/fake_slurm.py), each node its own torchrun agent and process tree, rendezvous on
127.0.0.1, each node's ranks seeing their node's SLURMD_NODENAME.

  - HSDP with replicate = "nodes": the layout log puts each shard group inside a node and each replicate group
    across both, and the losses equal a one-node torchrun run of the same HSDP 2 x 2 (read from TensorBoard);
  - one rank SIGKILLed mid-run: every process of the job ends, non-zero, within seconds, and torchrun names the
    rank;
  - one rank SIGSTOPped (a hang): the others time out after comm.train_timeout_seconds, the heartbeat watcher
    names the rank and its node, and every process ends non-zero.
No process of the job outlives a test (the finally kills whatever is left, SIGCONT first). The dry run prints the
same layout for 2 planned nodes of 2 GPUs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.integration import fake_slurm
from tests.train_runs import REPO, read_scalars, run_train

SCRIPT = REPO / "scripts" / "multinode_trainer.slurm"
COMMON = [
    "--model.flavor",
    "tinymodel",
    "--training.seq_len",
    "32",
    "--training.seed",
    "42",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmJob:
    """`bash scripts/multinode_trainer.slurm ARGS` as sbatch would run it, in a fake 2-node allocation."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str] | None = None):
        bin_dir = tmp_path / "bin"
        fake_slurm.install(bin_dir)
        self.tag = uuid.uuid4().hex
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            fake_slurm.JOB_TAG: self.tag,
            "SLURM_JOB_ID": str(4000 + os.getpid() % 1000),
            "SLURM_NNODES": "2",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "node[0-1]",
            "SLURM_SUBMIT_DIR": str(REPO),
            "NPROC_PER_NODE": "2",
            "CONFIG": "train_configs/debug_model.toml",
            "RDZV_HOST": "127.0.0.1",  # node0/node1 do not resolve here; every fake node is this machine
            "RDZV_PORT": str(_free_port()),
            "FAKE_SLURM_KILL_WAIT": "5",
            **(env or {}),
        }
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["bash", str(SCRIPT), *args],
            cwd=tmp_path,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.M):
            assert self.proc.poll() is None, f"the job ended before {pattern!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.tail()}"
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.tail()}") from None
        self._reader.join(timeout=10)
        return code

    def rank_pid(self, rank: int) -> tuple[int, str]:
        """(pid, node) of a training rank of this job."""
        for pid in fake_slurm.job_processes(self.tag):
            env = fake_slurm.process_env(pid)
            if env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
                return pid, env[fake_slurm.NODE_TAG]
        raise AssertionError(f"rank {rank} not found:\n{self.tail()}")

    def leftovers(self) -> list[int]:
        return fake_slurm.job_processes(self.tag)

    def kill(self) -> None:
        """End every process of the job, stopped ones too."""
        fake_slurm.kill_job(self.tag, wait=2)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def tail(self, n: int = 12000) -> str:
        return self.output[-n:]


@pytest.mark.slow
def test_slurm_two_nodes_hsdp_matches_one_node(tmp_path) -> None:
    steps = ["--training.steps", "5"]
    job = SlurmJob(
        tmp_path,
        COMMON
        + steps
        + ["--parallelism.data_parallel_replicate_degree", "nodes", "--job.dump_folder", str(tmp_path / "slurm")],
    )
    try:
        assert job.wait(timeout=180) == 0, job.tail()
    finally:
        job.kill()
    out = job.output
    assert "head node0, rendezvous 127.0.0.1" in out
    assert re.search(r"Layout: 4 ranks on 2 node\(s\) of 2 ranks; mesh \(replicate, shard, tp\) = \(2, 2, 1\)", out)
    nodes = re.search(r"nodes: (node\d) = ranks 0-1; (node\d) = ranks 2-3", out)
    assert nodes and {nodes[1], nodes[2]} == {"node0", "node1"}, out
    a, b = nodes[1], nodes[2]
    assert f"shard groups: 2 x 2 ranks, each inside one node: [0-1] on {a}; [2-3] on {b}" in out
    assert f"replicate groups: 2 x 2 ranks, each across 2 nodes, one rank on each: [0, 2] on {a}, {b}; [1, 3]" in out
    assert out.count("exited 0") == 2, out

    one_node = run_train(
        4,
        ["--config", "train_configs/debug_model.toml", *COMMON, *steps]
        + ["--parallelism.data_parallel_replicate_degree", "2", "--job.dump_folder", str(tmp_path / "one_node")],
    )
    assert one_node.returncode == 0, one_node.stderr[-6000:]
    got = read_scalars(tmp_path / "slurm" / "tb")["loss/train"]
    want = read_scalars(tmp_path / "one_node" / "tb")["loss/train"]
    assert sorted(got) == list(range(1, 6)) and got == want


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_slurm_dead_or_hung_rank_ends_the_job(tmp_path, how) -> None:
    """SIGKILL rank 2 or SIGSTOP rank 3 after step 3: every process exits non-zero, soon, and the rank is named."""
    timeout_s = 10
    args = COMMON + ["--training.steps", "100000", "--parallelism.data_parallel_replicate_degree", "nodes"]
    args += ["--comm.train_timeout_seconds", str(timeout_s), "--comm.heartbeat_seconds", "1"]
    job = SlurmJob(tmp_path, args + ["--job.dump_folder", str(tmp_path / "out")])
    try:
        job.wait_for(r"step:\s+3/", timeout=120)
        rank = 2 if how == "kill" else 3
        pid, node = job.rank_pid(rank)
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        bound = 20 if how == "kill" else timeout_s + 20
        code = job.wait(timeout=bound)
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 5
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not job.leftovers(), f"processes left behind: {job.leftovers()}\n{job.tail()}"
    finally:
        job.kill()
    out = job.output
    assert code != 0, out[-8000:]
    task_codes = [int(c) for c in re.findall(r"fake srun: task on node\d exited (-?\d+)", out)]
    assert len(task_codes) == 2 and all(task_codes), out[-8000:]
    if how == "kill":  # torchrun's summary on the rank's node names it, with its exit by SIGKILL (or a watcher does)
        summary = rf"rank\s*:\s*{rank} \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*-9"
        assert re.search(summary, out) or f"rank {rank} on host {node}: no heartbeat" in out, out[-8000:]
    else:  # the heartbeat watcher (rank 0) names it and its node; the survivors' collectives timed out
        named = rf"rank {rank} on host {node}: no heartbeat for [\d.]+ s \(dead, stopped or hung\)"
        assert re.search(named, out), out[-8000:]
        report = rf"rank 0 on host \w+: .*silent peers: rank {rank} on host {node} \(no heartbeat for \d+ s\)"
        assert re.search(report, out), out[-8000:]
        assert f"collective timed out after {timeout_s} s" in out, out[-8000:]
    print(f"{how}: the job ended {elapsed:.1f} s after the signal (exit {code}, tasks {task_codes})")
    print("".join(line for line in job.lines if re.search(r"on host|exitcode|rank\s+:|fake srun", line)))


@pytest.mark.slow
def test_slurm_usr1_before_the_time_limit_stops_saves_and_requeues(tmp_path) -> None:
    """SLURM's warning signal (USR1, `--signal=B:USR1@120`) to the batch script mid-run: the ranks of both nodes stop
    after the same step and save it, the job exits 138 and requeues itself; the requeued job (the same script run
    again) resumes at the next step, finishes, exits 0 and does not requeue. A config error is one message, exit 2."""
    requeued = tmp_path / "requeued"
    env = {"FAKE_SLURM_REQUEUED": str(requeued)}
    args = COMMON + ["--training.steps", "30", "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    args += ["--comm.heartbeat_seconds", "0", "--job.dump_folder", str(tmp_path / "out")]
    job = SlurmJob(tmp_path, args, env)
    try:
        job.wait_for(r"step:\s+3/", timeout=120)
        job.proc.send_signal(signal.SIGUSR1)
        code = job.wait(timeout=120)
    finally:
        job.kill()
    out = job.output
    assert code == 138, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    (line,) = [ln for ln in out.splitlines() if "stopped by SIGUSR1 after step" in ln]
    step = int(line.split("after step ")[1].split(";")[0])
    assert [p.name for p in (tmp_path / "out" / "checkpoint").iterdir()] == [f"step-{step}"]
    assert requeued.read_text().split() == [job.env["SLURM_JOB_ID"]], out[-3000:]

    again = SlurmJob(tmp_path, args, env)
    try:
        assert again.wait(timeout=180) == 0, again.tail()
    finally:
        again.kill()
    first = re.search(r"step:\s+(\d+)/", again.output)
    assert first and int(first[1]) == step + 1, again.tail()  # resumed, not restarted
    assert requeued.read_text().split() == [job.env["SLURM_JOB_ID"]]  # once

    bad = SlurmJob(tmp_path, [*COMMON, "--training.stepz", "5"], env)
    try:
        assert bad.wait(timeout=120) == 2, bad.tail()
    finally:
        bad.kill()
    unknown = "config error: unknown flag --training.stepz; did you mean --training.steps?"
    assert bad.output.count(unknown) == 1, bad.tail()
    assert "Traceback" not in bad.output, bad.tail()


def test_dry_run_prints_the_node_layout_of_the_real_run() -> None:
    """The planner, for 2 nodes x 2 GPUs, prints the layout the SLURM run above logs (node names node0, node1)."""
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--model.flavor", "tinymodel"]
        + ["--job.dry_run", "--job.dry_run_nodes", "2", "--job.dry_run_gpus_per_node", "2"]
        + ["--parallelism.data_parallel_replicate_degree", "nodes"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "Layout: 4 ranks on 2 node(s) of 2 ranks; mesh (replicate, shard, tp) = (2, 2, 1), row-major\n"
        "  nodes: node0 = ranks 0-1; node1 = ranks 2-3\n"
        "  shard groups: 2 x 2 ranks, each inside one node: [0-1] on node0; [2-3] on node1\n"
        "  replicate groups: 2 x 2 ranks, each across 2 nodes, one rank on each: [0, 2] on node0, node1; [1, 3] on "
        "node0, node1\n"
    ) in proc.stdout, proc.stdout
