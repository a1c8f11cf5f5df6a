"""Stand-ins for SLURM's `srun` and `scontrol`, so the real scripts/multinode_trainer.slurm runs on one machine
(`scontrol requeue JOBID` appends JOBID to the file $FAKE_SLURM_REQUEUED names).

`install(bin_dir)` writes two executables that call this file. The fake allocation is the environment a batch
script sees (SLURM_JOB_ID, SLURM_NNODES, SLURM_JOB_NODELIST = "node[0-1]", ...); `srun CMD` starts CMD once per
node, each a separate process tree with that node's SLURMD_NODENAME / SLURM_NODEID / SLURM_PROCID, as slurmstepd
would. Every process of the job carries FAKE_SLURM_JOB (and FAKE_SLURM_NODE) in its environment, which stands in
for SLURM's cgroups: torchrun starts each worker in a session of its own, so process groups do not reach them.
With --kill-on-bad-exit=1, when a node's task exits non-zero srun signals every process of the other nodes as
slurmstepd does (SIGCONT, SIGTERM, then SIGKILL after KillWait: FAKE_SLURM_KILL_WAIT seconds, default 5) and
exits with that task's code; otherwise it waits for every task.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

JOB_TAG = "FAKE_SLURM_JOB"
NODE_TAG = "FAKE_SLURM_NODE"


def install(bin_dir: Path) -> None:
    """Write `srun` and `scontrol` into bin_dir (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("srun", "scontrol"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
        path.chmod(0o755)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host lists: "node[0-1,4]", "a,b", "gpu[01-02]"."""
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            names.append(part)
            continue
        for item in m.group(2).split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{m.group(1)}{i:0{len(lo)}d}")
    return names


def scontrol(argv: list[str]) -> int:
    if argv[:1] == ["requeue"] and len(argv) == 2:  # recorded in $FAKE_SLURM_REQUEUED for the test to read
        with open(os.environ["FAKE_SLURM_REQUEUED"], "a") as f:
            f.write(f"{argv[1]}\n")
        return 0
    if argv[:2] != ["show", "hostnames"] or len(argv) != 3:
        print(
            f"fake scontrol: only `show hostnames LIST` and `requeue JOBID` are implemented, got {argv}",
            file=sys.stderr,
        )
        return 2
    print("\n".join(expand_nodelist(argv[2])))
    return 0


def job_processes(job: str, node: str | None = None) -> list[int]:
    """Live (not zombie) pids whose environment has FAKE_SLURM_JOB=job (and FAKE_SLURM_NODE=node)."""
    marks = [f"{JOB_TAG}={job}".encode()] + ([f"{NODE_TAG}={node}".encode()] if node else [])
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(m in env for m in marks):
            pids.append(int(entry.name))
    return pids


def process_env(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def signal_processes(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_job(job: str, node: str | None = None, wait: float = 0.0) -> None:
    """slurmstepd's kill of a step: SIGCONT and SIGTERM to every process, SIGKILL to those left after `wait` s."""
    signal_processes(job_processes(job, node), signal.SIGCONT)
    signal_processes(job_processes(job, node), signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and job_processes(job, node):
        time.sleep(0.1)
    signal_processes(job_processes(job, node), signal.SIGKILL)


def _parse_srun(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if "=" in arg:
            key, value = arg.split("=", 1)
        elif arg in ("-K", "--kill-on-bad-exit"):
            key, value = "--kill-on-bad-exit", "1"
        elif arg == "--overlap":  # a step beside the running one (one task per node, as every step here)
            key, value = arg, "1"
        else:
            key, value = arg, argv[i + 1]
            i += 1
        key = {"-K": "--kill-on-bad-exit", "-N": "--nodes", "-n": "--ntasks", "-w": "--nodelist"}.get(key, key)
        if key not in ("--kill-on-bad-exit", "--nodes", "--ntasks", "--nodelist", "--overlap", "--ntasks-per-node"):
            raise SystemExit(f"fake srun: option {key} is not implemented")
        opts[key] = value
        i += 1
    return opts, argv[i:]


def srun(argv: list[str]) -> int:
    opts, command = _parse_srun(argv)
    job = os.environ[JOB_TAG]
    nodes = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    if "--nodelist" in opts:
        nodes = [n for n in nodes if n in expand_nodelist(opts["--nodelist"])]
    kill_on_bad_exit = opts.get("--kill-on-bad-exit", "0") != "0"
    kill_wait = float(os.environ.get("FAKE_SLURM_KILL_WAIT", "5"))
    tasks = {}
    for node_id, node in enumerate(nodes):
        env = {
            **os.environ,
            NODE_TAG: node,
            "SLURMD_NODENAME": node,
            "SLURM_NODEID": str(node_id),
            "SLURM_PROCID": str(node_id),
            "SLURM_LOCALID": "0",
            "SLURM_STEP_NUM_NODES": str(len(nodes)),
        }
        tasks[node] = subprocess.Popen(command, env=env, start_new_session=True)
    first_failure = 0
    while tasks:
        for node, proc in list(tasks.items()):
            code = proc.poll()
            if code is None:
                continue
            del tasks[node]
            code = 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell reports it
            print(f"fake srun: task on {node} exited {code}", file=sys.stderr, flush=True)
            if code and not first_failure:
                first_failure = code
                if kill_on_bad_exit:
                    print("fake srun: --kill-on-bad-exit: killing the other tasks", file=sys.stderr, flush=True)
                    for other in tasks:
                        kill_job(job, other, kill_wait)
        time.sleep(0.1)
    return first_failure


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    sys.exit({"srun": srun, "scontrol": scontrol}[tool](args))
