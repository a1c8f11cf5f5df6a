"""The checkpoint folder on disk: which of its entries are committed steps, which are leftovers, and the small files
a step holds beside DCP's.

    <job.dump_folder>/<checkpoint.folder>/
        step-<N>/                  a committed checkpoint: DCP's .metadata and data files, config.toml (the resolved
                                   config), checksums.json (integrity.py), model_only (a last_save_model_only one)
        step-<N>-hf/               checkpoint.last_save_in_hf's Hugging Face form of step-<N> (convert.py)
        step-<N>[-hf].tmp-<id>/    a save in progress, or killed: never loaded; the next job's rank 0 deletes it
        step-<N>.deleting-<id>/    a pruned step on its way out (renamed first, so no partial step-<N> is left)
        step-<N>.damaged-<id>/     a damaged step a resume set aside (kept for inspection, never counted or loaded)

A step folder appears only by the rename that commits it (manager.py), so `step-<N>` with a `.metadata` is complete.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .dcp_io import METADATA

STEP_DIR = re.compile(r"^step-(\d+)$")
TEMP_DIR = re.compile(r"^step-\d+(-hf)?\.(tmp|deleting)-[0-9a-f]+$")
DAMAGED = "damaged"  # step-<N>.damaged-<id>: a damaged step set aside by a resume that skipped it
CONFIG = "config.toml"
MODEL_ONLY = "model_only"  # marks a last_save_model_only checkpoint: keep_latest_k neither counts nor deletes it


def step_folders(folder: str | Path) -> dict[int, Path]:
    """Every `step-<N>` folder (renamed, so meant to be complete) of a checkpoint folder, by step."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    out = {}
    for entry in folder.iterdir():
        m = STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = entry
    return dict(sorted(out.items()))


def complete_steps(folder: str | Path) -> list[int]:
    """The steps of the complete checkpoints (a step-<N> folder holding DCP's .metadata), oldest first."""
    return [s for s, path in step_folders(folder).items() if (path / METADATA).is_file()]


def fsync(path: Path) -> None:
    """Flush `path` (a file, or a folder: its entries, after a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CONFIG", "DAMAGED", "MODEL_ONLY", "STEP_DIR", "TEMP_DIR", "complete_steps", "fsync", "step_folders"]
