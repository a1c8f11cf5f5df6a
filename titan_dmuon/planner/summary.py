"""Per-rank figures as the plan reports them: min, median, max and every rank's value."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

GIB, MIB = 2.0**30, 2.0**20


def summary(values: np.ndarray) -> dict[str, Any]:
    v = [float(x) for x in values]
    return {"min": min(v), "median": float(statistics.median(v)), "max": max(v), "per_rank": v}
