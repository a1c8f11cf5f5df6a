"""Run a function on N real gloo ranks (spawned processes, free localhost port) and collect results.

Why spawn: each rank is a fresh interpreter, exactly like torchrun; no mocked collectives.
The target must be a module-level function (importable by the children).

`TITAN_DMUON_TEST_BACKEND=nccl` runs the same ranks on NCCL, rank r on `cuda:r` (NCCL cannot put two ranks on
one GPU: at most one rank per visible GPU), with TF32 off so fp32 matmuls stay fp32; `rank_device()` is the
device a rank builds its model and batches on (scripts/gpu_check.sh runs the parity tests this way).
"""

from __future__ import annotations

import faulthandler
import functools
import os
import pickle
import signal
import socket
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


def _entry(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
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
    path = os.path.join(outdir, f"rank{rank}.pkl")
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
        with open(path, "wb") as f:
            pickle.dump(("ok", result), f)
        # Free every group now, joining gloo's worker threads while the interpreter is alive: a worker that lets
        # go of an async collective's tensors during interpreter teardown aborts the process (SIGABRT).
        destroy_process_groups()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dump_stacks_and_kill(ctx: mp.ProcessContext, outdir: str) -> str:
    """Ask every live rank for its stacks (SIGUSR1 -> faulthandler), kill them all, return the stacks."""
    alive = [(rank, p) for rank, p in enumerate(ctx.processes) if p.is_alive()]
    for _, p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(5)
    parts = []
    for rank, _ in alive:
        path = os.path.join(outdir, f"rank{rank}.stack")
        text = open(path).read() if os.path.exists(path) else ""
        parts.append(f"---- rank {rank} (still running) ----\n{text or '(no stack written)'}")
    return "\n".join(parts)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks (NCCL ones with
    TITAN_DMUON_TEST_BACKEND=nccl); return each rank's result, its tensors on CPU.

    A run still going after ``timeout`` seconds (a hang: a collective one rank never joins) fails with the
    stack of every rank still running, and no rank outlives the call."""
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    if backend_name() == "nccl":
        import torch

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs (one rank per GPU); {gpus} visible")
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, free_port(), outdir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        errors = []
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    stacks = _dump_stacks_and_kill(ctx, outdir)
                    raise AssertionError(
                        f"distributed run of {world_size} ranks timed out after {timeout:g} s\n{stacks}"
                    )
        except AssertionError:
            raise
        except Exception as e:  # a child died: collect the per-rank tracebacks below
            errors.append(str(e))
        finally:  # on any way out (a test timeout too), no rank is left behind
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results
