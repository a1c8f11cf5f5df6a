"""Data: tokenizers, raw sources (offline stdlib default, text/JSONL/parquet), pre-tokenized token shards, a
global batch order independent of the cluster shape, up-front checks, and the stateful loader."""

from .checks import Census, checked_source, take_census
from .dataloader import DATASETS, VAL_FRACTION, MicroBatchLoader, build_dataloader, build_source
from .errors import DataError
from .packing import GlobalOrder, PackedDataset, Permutation, RowReader, interleave
from .shards import FORMAT, MANIFEST, ShardWriter, TokenSource, read_manifest, token_dtype, write_manifest
from .sources import (
    RAW_DATASETS,
    TEXT_DOCUMENTS,
    FileSource,
    HFDatasetSource,
    ParquetSource,
    RawSource,
    RecordSource,
    build_raw_source,
    in_val_split,
    iter_documents,
    list_files,
    stdlib_source,
)
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "Census",
    "checked_source",
    "take_census",
    "DATASETS",
    "VAL_FRACTION",
    "MicroBatchLoader",
    "build_dataloader",
    "build_source",
    "DataError",
    "GlobalOrder",
    "PackedDataset",
    "Permutation",
    "RowReader",
    "interleave",
    "FORMAT",
    "MANIFEST",
    "ShardWriter",
    "TokenSource",
    "read_manifest",
    "token_dtype",
    "write_manifest",
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
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
]
