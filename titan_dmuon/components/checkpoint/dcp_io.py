"""Reading DCP checkpoints without unpickling code: `.metadata` through an unpickler that admits only DCP's metadata
classes, non-tensor items (param group hyper-parameters) through torch.load(weights_only=True).

    metadata = read_metadata(step_folder)      # key -> global shape/dtype, and where each item's bytes are
    dcp.load(state, storage_reader=SafeReader(step_folder), planner=SafeLoadPlanner())

Every reader of a checkpoint goes through these: the resume (manager.py), the conversions (convert.py) and the
damage check, which plans the read as dcp.load does to know which blocks to check (manager.py, integrity.py).
Writing is DCP's FileSystemWriter hashing what it writes (integrity.py's ChecksummingWriter).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA = ".metadata"
"""DCP's metadata file in a checkpoint folder (written last, by the coordinator: its presence marks a finished save)."""

METADATA_ERRORS = (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError)
"""What `read_metadata` raises for a `.metadata` that cannot be read or is not DCP's metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's `.metadata` is made of: its dataclasses, torch.Size/dtypes, paths."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata; refusing to load it")


def read_metadata(path: str | Path, load_id: str | None = None) -> Metadata:
    """A checkpoint's DCP metadata (key -> global shape/dtype), read without unpickling arbitrary code."""
    with open(Path(path) / METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader whose `.metadata` goes through `read_metadata` (no code is unpickled)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(self.path, load_id=self.load_id)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor items (param group hyper-parameters) with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


__all__ = ["METADATA", "METADATA_ERRORS", "SafeLoadPlanner", "SafeReader", "read_metadata"]
