"""Run a function on N real gloo ranks (spawned processes, free localhost port) and collect results.

Why spawn: each rank is a fresh interpreter, exactly like torchrun; no mocked collectives.
The target must be a module-level function (importable by the children).
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears down while another still talks to it
        with open(path, "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, free_port(), outdir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        errors = []
        try:
            while not ctx.join(timeout=timeout):
                pass
        except Exception as e:  # a child died: collect the per-rank tracebacks below
            errors.append(str(e))
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
