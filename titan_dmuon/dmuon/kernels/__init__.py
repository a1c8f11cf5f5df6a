"""Triton kernels for the symmetric products of Newton-Schulz (docs/dmuon.md, "The update").

Nothing here imports Triton at package import: `load()` imports `kernels.syrk` (which imports Triton) on first
use and says why when it cannot, so `titan_dmuon.dmuon` imports on any machine, GPU or not.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """(the `syrk` kernel module, "") when Triton imports, else (None, the reason)."""
    try:
        from . import syrk
    except Exception as e:  # ImportError, or a Triton install that fails while importing its backends
        return None, f"triton does not import ({type(e).__name__}: {e})"
    return syrk, ""


__all__ = ["load"]
