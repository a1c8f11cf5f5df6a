"""Run a function on N real gloo ranks (spawned processes, free localhost port) and collect results.

Each rank is its own process, as under torchrun; no mocked collectives. The ranks are forked from one spawned
server that has imported torch (`_ForkServer`: importing torch is most of a small test's time), so every call
gets fresh processes and its own process group. The server freezes what its imports made (`gc.freeze`): a rank's
collections, and the trainer's teardown scan of live objects, never walk those again (the scan's effect is checked
where it matters, in processes that end through interpreter teardown: test_process_group_teardown, test_dmuon_exit
and the launcher tests; a forked rank ends in os._exit). The target must be a module-level function (importable by the
children).

`TITAN_DMUON_TEST_BACKEND=nccl` runs the same ranks on NCCL, rank r on `cuda:r` (NCCL cannot put two ranks on
one GPU: at most one rank per visible GPU), with TF32 off so fp32 matmuls stay fp32; `rank_device()` is the
device a rank builds its model and batches on (scripts/gpu_check.sh runs the parity tests this way).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import logging
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

ENV_BACKEND = "TITAN_DMUON_TEST_BACKEND"


def backend_name() -> str:
    """ "gloo" (default) or "nccl", from TITAN_DMUON_TEST_BACKEND."""
    backend = os.environ.get(ENV_BACKEND, "gloo").strip().lower() or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"{ENV_BACKEND}={backend!r}: use 'gloo' (CPU) or 'nccl' (one CUDA GPU per rank)")
    return backend


def rank_device():
    """This rank's device: CPU on gloo, `cuda:LOCAL_RANK` on nccl."""
    import torch

    if backend_name() == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it (dicts, lists, tuples) moved to CPU: results cross to the parent on CPU."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_cpu(v) for v in obj)
    return obj


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> tuple[str, Any]:
    """Run one rank of a job: ("ok", result) or ("error", traceback). The process group lives for the job."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    # On SIGUSR1 every thread's stack goes to this file: the parent asks for it when the run overstays.
    stack_file = open(os.path.join(outdir, f"rank{rank}.stack"), "w")  # stays open for the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        backend = backend_name()
        if backend == "nccl":
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32, as the CPU reference
            torch.backends.cudnn.allow_tf32 = False
            torch.cuda.set_device(rank_device())
            dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=rank_device())
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        if backend == "nccl":
            result = to_cpu(result)
        dist.barrier()  # no rank tears down while another still talks to it
        # No scan for the groups' other holders (`destroy_process_groups`, which a process that ends through
        # interpreter teardown needs): the rank ends in os._exit, which runs no teardown for a gloo worker to
        # abort in, and the scan would cost it most of a second.
        return "ok", result
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        return "error", traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_process(rank: int, world_size: int, port: int, outdir: str, job: bytes) -> None:
    """A forked rank: the caller's environment, then the job; its reply goes to `outdir/rank<r>.pkl`. Never
    returns (a forked child must not run the fork server's loop or its exit handlers)."""
    code = 1
    try:
        env, cwd, path, fn, args = pickle.loads(job)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        status = _run_rank(rank, world_size, port, outdir, fn, args)
        try:
            reply = pickle.dumps(status)
        except Exception:  # noqa: BLE001 - an unpicklable result is the test's error, reported as such
            status = ("error", f"the result cannot be pickled:\n{traceback.format_exc()}")
            reply = pickle.dumps(status)
        tmp = os.path.join(outdir, f"rank{rank}.pkl.tmp")
        with open(tmp, "wb") as f:
            f.write(reply)
        os.replace(tmp, os.path.join(outdir, f"rank{rank}.pkl"))
        code = 0 if status[0] == "ok" else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _script_process(rank: int, world_size: int, port: int, outdir: str, job: bytes) -> None:
    """A forked rank of a script run as `python SCRIPT ARGS` (one rank) or under torchrun (its environment
    variables): stdout and stderr to `outdir/rank<r>.out|.err`, the script's exit status as the process's."""
    code = 1
    try:
        env, cwd, path, script, argv = pickle.loads(job)
        for fd, name in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(outdir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ.clear()
        os.environ.update(env)
        if world_size > 1:  # what torchrun --standalone gives each worker
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                TORCHELASTIC_RUN_ID="none",
            )
        os.chdir(cwd)
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # as a new interpreter reads it
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *pythonpath, *path]
        sys.argv = [script, *argv]
        import torch

        if env.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_server(conn) -> None:
    """Import torch, the library and the trainer once, then fork the ranks of each job from this state.

    Every rank is still a process of its own that no earlier job touched (a fork of an interpreter that has
    imported but never run anything), so a job's patches, seeds and caches die with it. The server answers
    each job with its ranks' pids, then with ("exit", rank, code) as each ends, then with None."""
    import torch.distributed.fsdp  # noqa: F401 - the imports every rank would pay otherwise
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    import titan_dmuon.dmuon  # noqa: F401
    import titan_dmuon.trainer  # noqa: F401

    # What the imports made is never garbage: out of the collector's sight (gc.freeze), no rank's collections walk
    # it again or write to its pages (which a fork would otherwise copy, rank by rank).
    gc.freeze()
    conn.send_bytes(b"ready")
    while True:
        try:
            kind, world_size, port, outdir, job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            gc.unfreeze()  # this process's own teardown frees them as usual (nanobind counts what outlives it)
            return
        target = _rank_process if kind == "fn" else _script_process
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                conn.close()
                target(rank, world_size, port, outdir, job)
            pids.append(pid)
        conn.send_bytes(pickle.dumps(pids))
        for _ in pids:
            pid, status = os.wait()
            conn.send_bytes(pickle.dumps(("exit", pids.index(pid), os.waitstatus_to_exitcode(status))))
        conn.send_bytes(pickle.dumps(None))


class _ForkServer:
    """One spawned process that forks the ranks of every `run_distributed` call (see `_fork_server`).

    Why: a spawned rank spends seconds importing torch, 2-8 of them at once on CI's two cores, and the suite
    makes hundreds of multi-rank calls; a fork of an interpreter that already imported it starts in milliseconds.
    """

    def __init__(self) -> None:
        self.proc = None
        self.conn = None

    def start(self, timeout: float = 600) -> None:
        if self.proc is not None and self.proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_fork_server, args=(child,), name="rank-fork-server")
        self.proc.start()
        child.close()
        try:
            ready = self.conn.poll(timeout) and self.conn.recv_bytes() == b"ready"
        except (EOFError, OSError):  # it died while importing
            ready = False
        if not ready:
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"the rank fork server did not start within {timeout:g} s (exit code {code})")

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
        if self.proc is not None:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.proc = self.conn = None


_SERVER = _ForkServer()
atexit.register(_SERVER.close)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _dump_stacks(pids: dict[int, int], outdir: str) -> str:
    """Ask the given ranks for their stacks (SIGUSR1 -> faulthandler) and return them."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    parts = []
    for rank in sorted(pids):
        path = os.path.join(outdir, f"rank{rank}.stack")
        text = open(path).read() if os.path.exists(path) else ""
        parts.append(f"---- rank {rank} (still running) ----\n{text or '(no stack written)'}")
    return "\n".join(parts)


def _reply(outdir: str, rank: int) -> tuple[str, Any] | None:
    path = os.path.join(outdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _start(kind: str, world_size: int, outdir: str, job: bytes) -> list[int]:
    """Send a job to the fork server (started if needed); the pids of its ranks."""
    _SERVER.start()
    _SERVER.conn.send_bytes(pickle.dumps((kind, world_size, free_port(), outdir, job)))
    return pickle.loads(_SERVER.conn.recv_bytes())


def _exits(pids: list[int], deadline: float, on_exit: Callable[[int, int], None]) -> list[int] | None:
    """Each rank's exit code as the server reports it (`on_exit(rank, code)` as each comes), or None at the
    deadline (the ranks are still running)."""
    codes: list[int | None] = [None] * len(pids)
    conn = _SERVER.conn
    while True:
        if not conn.poll(max(0.0, min(0.2, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return None
            on_exit(-1, 0)  # a tick: the caller may look at the ranks' files
            continue
        event = pickle.loads(conn.recv_bytes())
        if event is None:
            return codes
        _, rank, code = event
        codes[rank] = code
        on_exit(rank, code)


def _stop(pids: list[int]) -> None:
    """Kill every rank still running and read the server's account of the job to its end (or drop the server)."""
    _kill(pids)
    conn = _SERVER.conn
    while conn is not None and conn.poll(30):
        if pickle.loads(conn.recv_bytes()) is None:
            return
    _SERVER.close()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks (NCCL ones with
    TITAN_DMUON_TEST_BACKEND=nccl); return each rank's result, its tensors on CPU.

    Each rank is a fresh process (forked by `_ForkServer` from an interpreter that has imported torch and run
    nothing) with the caller's environment, working directory and sys.path. A run still going after
    ``timeout`` seconds (a hang: a collective one rank never joins) fails with the stack of every rank still
    running, and no rank outlives the call. After a rank's error its peers get two seconds to report theirs (they
    may wait for it in a collective forever)."""
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    if backend_name() == "nccl":
        import torch

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs (one rank per GPU); {gpus} visible")
    job = pickle.dumps((dict(os.environ), os.getcwd(), list(sys.path), fn, args))
    with tempfile.TemporaryDirectory() as outdir:
        pids = _start("fn", world_size, outdir, job)
        failed_at: list[float] = []

        def watch(rank: int, code: int) -> None:
            if not failed_at and any((_reply(outdir, r) or ("ok",))[0] == "error" for r in range(world_size)):
                failed_at.append(time.monotonic())
            if failed_at and time.monotonic() > failed_at[0] + 2.0:
                _kill(pids)

        codes = None
        try:
            codes = _exits(pids, time.monotonic() + timeout, watch)
            if codes is None:
                waiting = {r: pid for r, pid in enumerate(pids) if _reply(outdir, r) is None}
                stacks = _dump_stacks(waiting, outdir)
                raise AssertionError(f"distributed run of {world_size} ranks timed out after {timeout:g} s\n{stacks}")
        finally:  # a failure, a hang or a test timeout: no rank is left behind
            if codes is None:
                _stop(pids)
        results, errors = [], []
        for rank in range(world_size):
            reply = _reply(outdir, rank)
            if reply is None:
                if codes[rank] != 0:
                    errors.append(f"rank {rank}: exited with code {codes[rank]} before reporting")
                results.append(None)
                continue
            status, value = reply
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors or any(codes):
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


def run_script(
    nproc: int, script: str, argv: list[str], *, cwd: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGV` (nproc 1) or `torchrun --standalone --nproc_per_node N SCRIPT ARGV`, as a finished
    `subprocess.run(..., capture_output=True, text=True)` would return it, with the ranks forked by the fork
    server (each a fresh process, started in milliseconds instead of seconds of imports).

    As under torchrun: a rank that exits non-zero stops the others (SIGTERM, SIGKILL after 10 s) and the run's
    status is 1 (one process: its own status); stdout and stderr are the ranks' in rank order. A run past
    `timeout` is killed and raises subprocess.TimeoutExpired."""
    env = dict(os.environ if env is None else env)
    job = pickle.dumps((env, cwd, list(sys.path), script, list(argv)))
    args = [sys.executable, script, *argv]
    with tempfile.TemporaryDirectory() as outdir:
        pids = _start("script", nproc, outdir, job)
        ended: dict[int, int] = {}
        failed_at: list[float] = []

        def watch(rank: int, code: int) -> None:
            if rank >= 0:
                ended[rank] = code
            if code != 0 and not failed_at:
                failed_at.append(time.monotonic())
                for r, pid in enumerate(pids):
                    if r not in ended:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGTERM)
            if failed_at and time.monotonic() > failed_at[0] + 10.0:
                _kill(pids)

        codes = None
        try:
            codes = _exits(pids, time.monotonic() + timeout, watch)
        finally:
            if codes is None:
                _stop(pids)

        def read(name: str) -> str:
            parts = []
            for rank in range(nproc):
                path = os.path.join(outdir, f"rank{rank}.{name}")
                if os.path.exists(path):
                    parts.append(open(path, errors="replace").read())
            return "".join(parts)

        if codes is None:
            raise subprocess.TimeoutExpired(args, timeout, read("out"), read("err"))
        status = codes[0] if nproc == 1 else int(any(codes))
        return subprocess.CompletedProcess(args, status, read("out"), read("err"))
