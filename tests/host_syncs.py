"""Counting host syncs on CPU: every call of a `torch.Tensor` method that reads a tensor's value to the host
(`item`, `tolist`, `__bool__` (`if t:`), `__float__`, `__int__`, `__index__`, `cpu`, `numpy`) made while the
context manager is open, in the main thread, with who made it.

On CUDA each of these waits for the device to finish the work queued before it: the host stops running ahead. On
CPU nothing waits, but the calls are the same, so a test on CPU can count them. What this cannot see: syncs inside
C++ (a boolean-mask index, `nonzero`, a `.to(cuda)` from unpinned memory, `torch.tensor(list, device=cuda)`);
`torch.cuda.set_sync_debug_mode` on a GPU does.

Calls torch makes on tensors it keeps on the host on a GPU too (HOST_SIDE: torch.optim's step counts) are not
counted. Each call is charged to the innermost frame of the stack inside the `titan_dmuon` package: `"dmuon"` for
`titan_dmuon/dmuon/` (the optimizer library), `"framework"` for the rest of the package (the trainer, its
components; torch code the trainer calls is charged to the trainer's line that called it), `"other"` when no frame
of the package is on the stack (the test itself).

    with HostSyncCounter(step=lambda: trainer.step) as syncs:
        trainer.train()
    syncs.select(owners=["framework"], steps=[2, 3])   # the calls the framework made during steps 2 and 3
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterable

import torch

import titan_dmuon

PACKAGE = os.path.dirname(os.path.abspath(titan_dmuon.__file__)) + os.sep
DMUON = os.path.join(PACKAGE, "dmuon") + os.sep
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@dataclasses.dataclass(frozen=True)
class Sync:
    method: str  # the Tensor method called
    owner: str  # "dmuon", "framework" or "other"
    where: str  # "path/relative/to/titan_dmuon.py:LINE in FUNCTION" of the charged frame
    step: int | None  # `step()` at the call, when the counter has one
    caller: str = ""  # the function that called the method: "torch/optim/optimizer.py in _get_value"


# Calls that read a tensor torch itself keeps on the host on a GPU too, so no device sync: torch.optim's step counts
# (`state["step"]`, a CPU tensor unless `capturable` or `fused`; `_get_value` reads it by `.item()`).
HOST_SIDE = ("torch/optim/optimizer.py in _get_value",)


def _short(path: str) -> str:
    """`path` from its package's folder on: .../site-packages/torch/optim/adam.py -> torch/optim/adam.py."""
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        root = os.path.abspath(root) + os.sep
        if path.startswith(root):
            return path[len(root) :]
    return path


class HostSyncCounter:
    """Patches the READS methods of torch.Tensor while open; `syncs` is every call in the main thread, in order.
    `step`: a function giving the current step (e.g. `lambda: trainer.step`), recorded with each call."""

    def __init__(self, step: Callable[[], int] | None = None):
        self.step = step
        self.syncs: list[Sync] = []
        self._saved: dict[str, object] = {}
        self._busy = threading.local()  # no recording of what the recorder itself calls

    def _record(self, method: str) -> None:
        if threading.current_thread() is not threading.main_thread() or getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            owner, where = "other", ""
            frame = sys._getframe(2)  # the caller of the patched method
            caller = f"{_short(frame.f_code.co_filename)} in {frame.f_code.co_name}"
            while frame is not None:
                path = frame.f_code.co_filename
                if path.startswith(PACKAGE):
                    owner = "dmuon" if path.startswith(DMUON) else "framework"
                    where = f"{os.path.relpath(path, PACKAGE)}:{frame.f_lineno} in {frame.f_code.co_name}"
                    break
                frame = frame.f_back
            step = self.step() if self.step is not None else None
            if caller not in HOST_SIDE:
                self.syncs.append(Sync(method, owner, where, step, caller))
        finally:
            self._busy.on = False

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            self._record(name)
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def __enter__(self) -> HostSyncCounter:
        for name in READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def select(self, owners: Iterable[str] | None = None, steps: Iterable[int] | None = None) -> list[Sync]:
        """The calls of those owners (default: all) during those steps (default: all)."""
        owners = None if owners is None else set(owners)
        steps = None if steps is None else set(steps)
        return [s for s in self.syncs if (owners is None or s.owner in owners) and (steps is None or s.step in steps)]

    def by_step(self, owners: Iterable[str] | None = None) -> dict[int | None, int]:
        """{step: number of calls} of those owners."""
        out: dict[int | None, int] = {}
        for s in self.select(owners):
            out[s.step] = out.get(s.step, 0) + 1
        return out


def describe(syncs: list[Sync]) -> str:
    """One line per distinct (step, method, owner, where), with its count: for an assertion message."""
    counts: dict[tuple, int] = {}
    for s in syncs:
        key = (s.step, s.method, s.owner, s.where)
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"  step {k[0]}: {k[1]} x{n} ({k[2]}) at {k[3]}" for k, n in counts.items())
