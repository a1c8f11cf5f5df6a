"""Tokenizers, text sources (offline stdlib default, text/JSONL/parquet), packing and the stateful loader."""

from .dataloader import build_dataloader, build_dataset
from .datasets import (
    DATASETS,
    DocumentSource,
    PackedDataset,
    StreamPosition,
    build_source,
    iter_documents,
    split_mask,
    stdlib_source,
)
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "build_dataloader",
    "build_dataset",
    "DATASETS",
    "DocumentSource",
    "PackedDataset",
    "StreamPosition",
    "build_source",
    "iter_documents",
    "split_mask",
    "stdlib_source",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
]
