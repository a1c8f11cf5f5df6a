"""A process's random generator states (torch CPU and CUDA, Python, NumPy) as tensors, so that a checkpoint holds no
pickled objects; the checkpoint saves each rank's under `rng.rank<R>` (manager.py)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states as tensors (no pickled objects in the checkpoint)."""
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor(float("nan") if gauss is None else gauss, dtype=torch.float64),
        "numpy": torch.tensor([*np_state[1].tolist(), np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor(np_state[4], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned (CUDA's only where it was saved and CUDA is here)."""
    torch.set_rng_state(state["torch"])
    py = state["python"].tolist()
    gauss = float(state["python_gauss"])
    random.setstate((py[0], tuple(py[1:]), None if np.isnan(gauss) else gauss))
    npy = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(npy[:-2], dtype=np.uint32), npy[-2], npy[-1], float(state["numpy_gauss"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


__all__ = ["rng_state", "set_rng_state"]
