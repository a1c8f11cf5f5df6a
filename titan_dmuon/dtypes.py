"""The one map from a dtype's name to the torch.dtype, for every option and config field that names one.

A leaf module (torch only): the optimizer library (titan_dmuon/dmuon/options.py, which re-exports it as
`dmuon.DTYPES` / `dmuon.to_dtype`) and the framework (the checkpoint's export dtype, FSDP2's mixed precision) share it
without the framework importing the library, whose import installs its FSDP2 patch, merely to spell a dtype.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""The dtype names every option (and the framework's config) spells a dtype with -> the torch.dtype."""


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`dtype` as a torch.dtype: a torch.dtype as it is, a name of DTYPES ("float32", "bfloat16", "float16",
    "float64"; a "torch." prefix is allowed) looked up. ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unknown dtype {dtype!r}: use a torch.dtype or one of {', '.join(map(repr, DTYPES))}")


__all__ = ["DTYPES", "to_dtype"]
