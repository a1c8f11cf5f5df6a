"""Data: tokenizers, raw sources (offline stdlib default, text/JSONL/parquet), pre-tokenized token shards, a
global batch order independent of the cluster shape, up-front checks, and the stateful loader.

The names below are imported on first use: the path checks a launch runs before anything else
(titan_dmuon/preflight.py) take `sources`, `shards` and `tokenizer` without importing torch, which the loader and
the checks need."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "checks": ("Census", "checked_source", "take_census"),
    "dataloader": ("DATASETS", "VAL_FRACTION", "MicroBatchLoader", "build_dataloader", "build_source"),
    "errors": ("DataError",),
    "packing": ("GlobalOrder", "PackedDataset", "Permutation", "RowReader", "interleave"),
    "shards": ("FORMAT", "MANIFEST", "ShardWriter", "TokenSource", "read_manifest", "token_dtype", "write_manifest"),
    "sources": (
        "RAW_DATASETS",
        "TEXT_DOCUMENTS",
        "FileSource",
        "HFDatasetSource",
        "ParquetSource",
        "RawSource",
        "RecordSource",
        "build_raw_source",
        "in_val_split",
        "iter_documents",
        "list_files",
        "stdlib_source",
    ),
    "tokenizer": ("ByteTokenizer", "HFTokenizer", "Tokenizer", "build_tokenizer"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__all__ = sorted(_MODULE_OF)
