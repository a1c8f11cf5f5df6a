"""Run a function on N real gloo ranks (spawned processes, free localhost port) and collect results.

Each rank is its own process, as under torchrun; no mocked collectives. The ranks are forked from one spawned
server that has imported torch (`_ForkServer`: importing torch is most of a small test's time), so every call
gets fresh processes and its own process group. The target must be a module-level function (importable by the
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
import os
import pickle
import signal
import socket
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

    from titan_dmuon.parallel.runtime import destroy_process_groups

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
        # Free every group now, joining gloo's worker threads while the interpreter is alive: a worker that lets
        # go of an async collective's tensors during interpreter teardown aborts the process (SIGABRT).
        destroy_process_groups()
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


def _fork_server(conn) -> None:
    """Import torch and the library once, then fork the ranks of each job from this state.

    Every rank is still a process of its own that no earlier job touched (a fork of an interpreter that has
    imported but never run anything), so a job's patches, seeds and caches die with it. The server answers
    each job with its ranks' pids, then with their exit codes once all have ended."""
    import torch.distributed.fsdp  # noqa: F401 - the imports every rank would pay otherwise

    import titan_dmuon.dmuon  # noqa: F401

    conn.send_bytes(b"ready")
    while True:
        try:
            world_size, port, outdir, job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                conn.close()
                _rank_process(rank, world_size, port, outdir, job)
            pids.append(pid)
        conn.send_bytes(pickle.dumps(pids))
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        conn.send_bytes(pickle.dumps(codes))


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


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks (NCCL ones with
    TITAN_DMUON_TEST_BACKEND=nccl); return each rank's result, its tensors on CPU.

    Each rank is a fresh process (forked by `_ForkServer` from an interpreter that has imported torch and run
    nothing) with the caller's environment, working directory and sys.path. A run still going after
    ``timeout`` seconds (a hang: a collective one rank never joins) fails with the stack of every rank still
    running, and no rank outlives the call."""
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    if backend_name() == "nccl":
        import torch

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs (one rank per GPU); {gpus} visible")
    _SERVER.start()
    conn = _SERVER.conn
    job = pickle.dumps((dict(os.environ), os.getcwd(), list(sys.path), fn, args))
    with tempfile.TemporaryDirectory() as outdir:
        conn.send_bytes(pickle.dumps((world_size, free_port(), outdir, job)))
        pids: list[int] = pickle.loads(conn.recv_bytes())
        codes = None
        try:
            codes, failed = _wait(conn, pids, outdir, timeout)
        finally:  # a failure, a hang or a test timeout: no rank is left behind
            if codes is None:
                _kill(pids)
                if not (conn.poll(30) and conn.recv_bytes()):  # the server's exit codes: it is ready again
                    _SERVER.close()
        results, errors = [], []
        for rank in range(world_size):
            reply = _reply(outdir, rank)
            if reply is None:
                if codes is not None and codes[rank] != 0:
                    errors.append(f"rank {rank}: exited with code {codes[rank]} before reporting")
                results.append(None)
                continue
            status, value = reply
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors or failed:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


def _wait(conn, pids: list[int], outdir: str, timeout: float) -> tuple[list[int] | None, bool]:
    """Wait for the server's exit codes of `pids`: (codes, whether a rank failed). After a rank reported an
    error its peers get two seconds to report theirs (they may wait for it in a collective forever), then go."""
    deadline = time.monotonic() + timeout
    failed = False
    while not conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
        now = time.monotonic()
        if not failed and any((_reply(outdir, r) or ("ok",))[0] == "error" for r in range(len(pids))):
            failed, deadline = True, min(deadline, now + 2.0)
        if now >= deadline:
            if failed:
                _kill(pids)
                break
            waiting = {r: pid for r, pid in enumerate(pids) if _reply(outdir, r) is None}
            stacks = _dump_stacks(waiting, outdir)
            raise AssertionError(f"distributed run of {len(pids)} ranks timed out after {timeout:g} s\n{stacks}")
    codes = pickle.loads(conn.recv_bytes())
    return codes, failed or any(codes)
