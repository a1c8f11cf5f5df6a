"""Text sources, a deterministic train/val split, and the packed, DP-sharded, resumable token stream.

The stream is the concatenation of the split's documents (each ``BOS text EOS``), in a per-epoch order, looping
forever for training. It is cut into windows of ``seq_len + 1`` tokens with stride ``seq_len`` (consecutive
windows share one token, so every token is a label exactly once). Global window ``g`` belongs to DP rank
``g % dp_world_size``; windows are produced in rounds of ``dp_world_size`` and the saved position is the
stream position after a full round, so it is the same on every DP rank. Documents are read and tokenized
lazily, one at a time.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

logger = logging.getLogger(__name__)

DATASETS = ("stdlib", "text", "jsonl", "parquet")
_STDLIB_EXCLUDE = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------------------------- sources
class DocumentSource:
    """Random access to documents in a fixed order; ``key(i)`` is a stable name used for the split."""

    # [start, stop) ranges whose docs shuffling keeps together (e.g. a parquet row group); None: every doc alone.
    blocks: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def key(self, i: int) -> str:
        raise NotImplementedError

    def text(self, i: int) -> str:
        raise NotImplementedError


def _list_files(path: str, suffixes: tuple[str, ...], exclude_dirs: set[str] = frozenset()) -> list[str]:
    """``path`` itself if a file, else the files under it with one of ``suffixes``, sorted by relative path."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset path {path!r} does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in exclude_dirs]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes)]
    found.sort(key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))
    if not found:
        raise FileNotFoundError(f"no {'/'.join(suffixes)} files under {path!r}")
    return found


def _relname(path: str, root: str) -> str:
    base = root if os.path.isdir(root) else os.path.dirname(root)
    return os.path.relpath(path, base).replace(os.sep, "/")


class FileSource(DocumentSource):
    """One document per file (UTF-8; undecodable bytes are replaced)."""

    def __init__(self, files: Sequence[str], root: str):
        self.files = list(files)
        self.keys = [_relname(f, root) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def key(self, i: int) -> str:
        return self.keys[i]

    def text(self, i: int) -> str:
        with open(self.files[i], encoding="utf-8", errors="replace") as f:
            return f.read()


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_source() -> FileSource:
    """The embedded offline corpus: this interpreter's standard library ``.py`` files, without test suites,
    idlelib or installed packages (~12 MB)."""
    root = stdlib_root()
    return FileSource(_list_files(root, (".py",), _STDLIB_EXCLUDE), root)


class JsonlSource(DocumentSource):
    """One document per non-empty JSONL line, ``record[field]``. Line offsets are indexed once up front."""

    def __init__(self, files: Sequence[str], root: str, field: str = "text"):
        self.files, self.field = list(files), field
        self.names = [_relname(f, root) for f in self.files]
        self.index: list[tuple[int, int, int]] = []  # (file, byte offset, line number)
        for fi, path in enumerate(self.files):
            with open(path, "rb") as f:
                offset = 0
                for lineno, line in enumerate(f):
                    if line.strip():
                        self.index.append((fi, offset, lineno))
                    offset += len(line)

    def __len__(self) -> int:
        return len(self.index)

    def key(self, i: int) -> str:
        fi, _, lineno = self.index[i]
        return f"{self.names[fi]}:{lineno}"

    def text(self, i: int) -> str:
        fi, offset, lineno = self.index[i]
        with open(self.files[fi], "rb") as f:
            f.seek(offset)
            record = json.loads(f.readline())
        if self.field not in record:
            raise KeyError(f"{self.files[fi]}:{lineno + 1}: no field {self.field!r} (has {sorted(record)})")
        return str(record[self.field])


class ParquetSource(DocumentSource):
    """One document per row, ``column``. Rows are read a row group at a time (one group cached), and each row
    group is a shuffle block, so shuffling never reads a group more than once per epoch."""

    def __init__(self, files: Sequence[str], root: str, column: str = "text"):
        import pyarrow.parquet as pq

        self.files, self.column = list(files), column
        self.names = [_relname(f, root) for f in self.files]
        self.groups: list[tuple[int, int, int]] = []  # (file, row group, first global row)
        self.file_starts: list[int] = []  # first global row of each file
        self.blocks = []
        n = 0
        for fi, path in enumerate(self.files):
            self.file_starts.append(n)
            pf = pq.ParquetFile(path)
            if column not in pf.schema_arrow.names:
                raise KeyError(f"{path}: no column {column!r} (has {pf.schema_arrow.names})")
            for rg in range(pf.num_row_groups):
                rows = pf.metadata.row_group(rg).num_rows
                self.groups.append((fi, rg, n))
                self.blocks.append((n, n + rows))
                n += rows
        self._n = n
        self._starts = [g[2] for g in self.groups]
        self._cache: tuple[int, list[Any]] | None = None

    def __len__(self) -> int:
        return self._n

    def _locate(self, i: int) -> tuple[int, int]:
        g = bisect.bisect_right(self._starts, i) - 1
        return g, i - self._starts[g]

    def key(self, i: int) -> str:
        fi = self.groups[self._locate(i)[0]][0]
        return f"{self.names[fi]}:{i - self.file_starts[fi]}"

    def text(self, i: int) -> str:
        import pyarrow.parquet as pq

        g, row = self._locate(i)
        if self._cache is None or self._cache[0] != g:
            fi, rg, _ = self.groups[g]
            table = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=[self.column])
            self._cache = (g, table.column(self.column).to_pylist())
        value = self._cache[1][row]
        return "" if value is None else str(value)


def build_source(dataset: str, dataset_path: str = "", dataset_field: str = "text") -> DocumentSource:
    """``stdlib`` (offline default, path ignored), ``text`` (a file or a directory of .txt/.md),
    ``jsonl`` (``dataset_field`` per line) or ``parquet`` (column ``dataset_field``)."""
    if dataset == "stdlib":
        return stdlib_source()
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {DATASETS}")
    if not dataset_path:
        raise ValueError(f"dataset {dataset!r} needs a dataset_path")
    if dataset == "text":
        return FileSource(_list_files(dataset_path, (".txt", ".md")), dataset_path)
    if dataset == "jsonl":
        return JsonlSource(_list_files(dataset_path, (".jsonl",)), dataset_path, dataset_field or "text")
    return ParquetSource(_list_files(dataset_path, (".parquet",)), dataset_path, dataset_field or "text")


# ---------------------------------------------------------------------------------------------- split
def split_mask(source: DocumentSource, split: str, val_fraction: float = 0.02) -> np.ndarray:
    """Boolean mask of the documents in ``split``: a document is held out for "val" when the CRC32 of its key
    falls in the lowest ``val_fraction`` of the hash range, so the split is stable as documents come and go.
    Both splits are kept non-empty when there are at least two documents."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    hashes = np.array([zlib.crc32(source.key(i).encode()) for i in range(len(source))], dtype=np.uint64)
    val = hashes < int(val_fraction * 2**32)
    if len(source) >= 2 and not val.any():
        val[np.argmin(hashes)] = True
    if len(source) >= 2 and val.all():
        val[np.argmax(hashes)] = False
    mask = val if split == "val" else ~val
    if not mask.any():
        raise ValueError(f"the {split!r} split of this dataset is empty ({len(source)} documents)")
    return mask


def iter_documents(
    source: DocumentSource, split: str = "train", val_fraction: float = 0.02, max_docs: int | None = None
) -> Iterator[str]:
    """The split's document texts in source order (e.g. for tokenizer training)."""
    mask = split_mask(source, split, val_fraction)
    for n, i in enumerate(np.flatnonzero(mask)):
        if max_docs is not None and n >= max_docs:
            return
        yield source.text(int(i))


# --------------------------------------------------------------------------------------------- stream
@dataclass
class StreamPosition:
    """Where the next round of windows starts: document ``doc_pos`` of ``epoch``'s order, token ``offset``
    inside it, preceded by the ``carry`` tokens left over from earlier documents."""

    epoch: int = 0
    doc_pos: int = 0
    offset: int = 0
    carry: list[int] = field(default_factory=list)


class PackedDataset(IterableDataset):
    """Packed ``(inputs, labels)`` windows for one DP rank; ``state_dict``/``load_state_dict`` hold the
    position, so torchdata's ``StatefulDataLoader`` resumes exactly. Training loops over epochs forever;
    validation is one pass that restarts on every ``iter`` and ends on a full round (equal counts per rank)."""

    def __init__(
        self,
        source: DocumentSource,
        tokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        split: str = "train",
        seed: int = 0,
        shuffle: bool | None = None,
        val_fraction: float = 0.02,
    ):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_world_size})")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.split, self.seed = split, seed
        self.infinite = split == "train"
        self.shuffle = self.infinite if shuffle is None else shuffle
        self.mask = split_mask(source, split, val_fraction)
        self.num_docs = int(self.mask.sum())
        self._pos = StreamPosition()
        self._resume = False  # val restarts on each iter unless a state was just loaded
        self._cached_order: tuple[int, np.ndarray] | None = None

    # The order of one epoch: source order, or (shuffled) blocks in a seeded order and docs inside each block.
    def _order(self, epoch: int) -> np.ndarray:
        if self._cached_order is not None and self._cached_order[0] == epoch:
            return self._cached_order[1]
        rng = np.random.default_rng([self.seed, epoch])
        blocks = self.source.blocks
        if self.shuffle and blocks is None:
            order = rng.permutation(len(self.source))
        elif self.shuffle:
            order = np.concatenate([rng.permutation(np.arange(*blocks[b])) for b in rng.permutation(len(blocks))])
        else:
            order = np.arange(len(self.source))
        order = order[self.mask[order]]
        self._cached_order = (epoch, order)
        return order

    def _encode(self, doc: int) -> np.ndarray:
        text = self.source.text(int(doc))
        if not text:
            return np.empty(0, dtype=np.int64)
        if hasattr(self.tokenizer, "encode_array"):
            return self.tokenizer.encode_array(text, bos=True, eos=True)
        return np.asarray(self.tokenizer.encode(text, bos=True, eos=True), dtype=np.int64)

    def _global_windows(self, pos: StreamPosition) -> Iterator[tuple[np.ndarray, StreamPosition]]:
        """Every window of the stream from ``pos`` on, each with the position right after it."""
        epoch, doc_pos, offset, size = pos.epoch, pos.doc_pos, pos.offset, self.seq_len + 1
        buf = np.asarray(pos.carry, dtype=np.int64)
        while True:
            order, epoch_tokens, whole_epoch = self._order(epoch), 0, doc_pos == 0 and offset == 0
            while doc_pos < len(order):
                toks = self._encode(order[doc_pos])
                epoch_tokens += len(toks)
                while True:
                    need = size - len(buf)
                    if len(toks) - offset < need:
                        buf = np.concatenate([buf, toks[offset:]])
                        doc_pos, offset = doc_pos + 1, 0
                        break
                    window = np.concatenate([buf, toks[offset : offset + need]])
                    offset += need
                    buf = window[self.seq_len :]
                    yield window, StreamPosition(epoch, doc_pos, offset, buf.tolist())
            if not self.infinite:
                return
            if whole_epoch and epoch_tokens == 0:
                raise ValueError(f"the {self.split!r} split has no tokens (all documents empty)")
            epoch, doc_pos, offset = epoch + 1, 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.infinite and not self._resume:
            self._pos = StreamPosition()
        self._resume = False
        # With DataLoader workers, each worker of each DP rank is its own shard of the windows.
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        shards, shard = self.dp_world_size * nw, self.dp_rank * nw + wid
        windows = self._global_windows(self._pos)
        while True:
            mine = None
            for i in range(shards):
                try:
                    window, pos = next(windows)
                except StopIteration:
                    return  # drop an incomplete final round (validation only)
                if i == shard:
                    mine = window
            self._pos = pos
            t = torch.from_numpy(mine)
            yield t[:-1], t[1:]

    def state_dict(self) -> dict[str, Any]:
        return asdict(self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pos = StreamPosition(**state)
        self._resume = True
