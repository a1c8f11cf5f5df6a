"""Raw text sources: documents read straight from text, JSONL or parquet files (the offline default and small
corpora; large corpora are tokenized once by scripts/prepare_data.py and read from shards, see shards.py).

A source is a list of *units* that are read independently: a file, a byte range of a file, a parquet row
group. ``texts(u)`` returns the documents that start in unit ``u``, so a rank reads only the units it packs
and nothing holds an index of every document: a JSONL or text file is cut into byte ranges, and a range owns
the lines (or paragraphs) that start inside it. A document is held out for validation when the CRC32 of its
text falls in the lowest ``val_fraction`` of the hash range: stable whichever file or position it comes
from, duplicates on the same side, and the same rule in prepare_data.py. On a small corpus that rule can hold
out none of the documents (49 at 2%: 37% of corpora) or all of them; the up-front check (checks.py), which reads
every document once, then moves the bound (``RawSource.val_bound``) so that a ``val_fraction`` in (0, 1) holds
out at least one of two or more documents and never all of them.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence

from .errors import DataError

RAW_DATASETS = ("stdlib", "text", "jsonl", "parquet")
TEXT_DOCUMENTS = ("blank_line", "file")
_SUFFIXES = {"text": (".txt", ".md"), "jsonl": (".jsonl",), "parquet": (".parquet",)}
_STDLIB_EXCLUDE = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 1 << 20


def text_crc(text: str) -> int:
    """The CRC32 of a document's UTF-8 text: what assigns it to a split."""
    return zlib.crc32(text.encode("utf-8", errors="replace"))


def in_val_split(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split by the hash rule (CRC32 of its UTF-8 text below the
    fraction of the hash range). A checked raw source may move that bound on a small corpus (``val_bound``)."""
    return text_crc(text) < val_fraction * 2**32


class RawSource:
    """Units of documents read from files. ``split`` (None, "train" or "val") filters ``documents(u)``."""

    split: str | None = None
    val_fraction: float = 0.0
    val_threshold: float | None = None  # set by the up-front check (checks.Census.split_bound); None: the hash rule
    description: str = ""

    def val_bound(self) -> float:
        """A document is held out when the CRC32 of its text is below this: ``val_fraction`` of the hash range,
        unless the up-front check moved it (a small corpus the hash rule would hold out none or all of)."""
        return self.val_fraction * 2**32 if self.val_threshold is None else self.val_threshold

    def __len__(self) -> int:
        raise NotImplementedError

    def texts(self, u: int) -> list[str]:
        """Every non-empty document that starts in unit ``u``, in file order."""
        raise NotImplementedError

    def documents(self, u: int) -> list[str]:
        """The documents of unit ``u`` in this source's split."""
        docs = self.texts(u)
        if self.split is None:
            return docs
        want_val, bound = self.split == "val", self.val_bound()
        return [t for t in docs if (text_crc(t) < bound) == want_val]

    def counted_documents(self) -> int | None:
        """The number of documents when the file metadata holds it (parquet), else None (count by reading)."""
        return None

    def identity(self) -> tuple:
        """What a check of this source depends on: its files as they are now, and how they are cut."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------- files
def list_files(path: str, suffixes: tuple[str, ...], exclude_dirs: frozenset[str] = frozenset()) -> list[str]:
    """``path`` itself if a file; the files a glob matches (sorted); or the files under a folder with one of
    ``suffixes`` (sorted by relative path). Raises ``DataError`` naming ``path`` when that is nothing."""
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{path!r} matches no files; check the pattern (quote it so the shell does not expand it)")
        return files
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path} does not exist; set the dataset path to a file, a folder or a glob")
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in exclude_dirs]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes)]
    found.sort(key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))
    if not found:
        raise DataError(f"{path}: no {' / '.join(suffixes)} files in this folder; is the dataset kind right?")
    return found


def describe_files(files: Sequence[str], where: str, kind: str) -> str:
    """How messages name a corpus: its one file, or where it is and how many files."""
    return files[0] if len(files) == 1 else f"{where} ({len(files)} {kind} files)"


def _stat_identity(files: Sequence[str]) -> tuple:
    return tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])


def line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte ``offset`` (counted only when an error needs it)."""
    count, pos = 1, 0
    with open(path, "rb") as f:
        while pos < offset:
            block = f.read(min(1 << 20, offset - pos))
            if not block:
                break
            count += block.count(b"\n")
            pos += len(block)
    return count


class FileSource(RawSource):
    """One document per file (UTF-8; undecodable bytes are replaced); a unit is a file."""

    def __init__(self, files: Sequence[str], description: str = ""):
        self.files = list(files)
        self.description = description or f"{len(self.files)} files"

    def __len__(self) -> int:
        return len(self.files)

    def texts(self, u: int) -> list[str]:
        with open(self.files[u], "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        return [text] if text.strip() else []

    def identity(self) -> tuple:
        return ("file", _stat_identity(self.files))


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_source() -> FileSource:
    """The embedded offline corpus: this interpreter's standard library ``.py`` files, without test suites,
    idlelib or installed packages (~12 MB), one document per file."""
    root = stdlib_root()
    return FileSource(list_files(root, (".py",), _STDLIB_EXCLUDE), f"the standard library under {root}")


class RecordSource(RawSource):
    """Documents delimited inside files: one per non-blank JSONL line (``record[field]``), or one per paragraph
    of a text file (a run of non-blank lines). A unit is a byte range of ``chunk_bytes`` of one file and owns
    the documents that start in it, so reading a unit needs no index of the file."""

    def __init__(
        self, files: Sequence[str], kind: str, field: str = "text", chunk_bytes: int = MAX_CHUNK_BYTES, where: str = ""
    ):
        if kind not in ("jsonl", "paragraphs"):
            raise ValueError(f"kind must be 'jsonl' or 'paragraphs', got {kind!r}")
        self.files, self.kind, self.field, self.chunk = list(files), kind, field, chunk_bytes
        self.sizes = [os.path.getsize(f) for f in self.files]
        counts = [-(-size // chunk_bytes) for size in self.sizes]
        self.starts = [sum(counts[:i]) for i in range(len(counts) + 1)]  # first unit of each file; O(files)
        self.description = describe_files(self.files, where, "jsonl" if kind == "jsonl" else "text")

    def __len__(self) -> int:
        return self.starts[-1]

    def identity(self) -> tuple:
        return (self.kind, self.field, self.chunk, _stat_identity(self.files))

    def _range(self, u: int) -> tuple[str, int, int]:
        fi = bisect.bisect_right(self.starts, u) - 1
        start = (u - self.starts[fi]) * self.chunk
        return self.files[fi], start, min(start + self.chunk, self.sizes[fi])

    def texts(self, u: int) -> list[str]:
        path, start, stop = self._range(u)
        if self.kind == "jsonl":
            return [t for t in (self._field(path, offset, line) for offset, line in _lines(path, start, stop)) if t]
        return [t.decode("utf-8", errors="replace") for _, t in _paragraphs(path, start, stop)]

    def _field(self, path: str, offset: int, line: bytes) -> str:
        try:
            record = json.loads(line.rstrip(b"\r\n"))  # (an error at the line's end stays on this line)
        except ValueError as e:
            raise DataError(json_line_error(path, line_number(path, offset), line, e)) from None
        if not isinstance(record, dict) or self.field not in record:
            has = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{line_number(path, offset)}: no field {self.field!r} (the record has {has}); set the "
                "dataset field to the key that holds the text"
            )
        value = record[self.field]
        return "" if value is None else value if isinstance(value, str) else str(value)


def json_line_error(path: str, number: int, line: bytes, e: ValueError) -> str:
    """One line naming where line ``number`` of ``path`` stops being JSON and the fix: the file, the line and
    column (the line holds one JSON document, so json's line 1 column C is column C of that line), json's own
    message whole (its ``msg``, ``lineno``, ``colno`` and ``pos``), and the text around that column."""
    text = line.rstrip(b"\r\n").decode("utf-8", errors="replace")
    if isinstance(e, json.JSONDecodeError):
        where = f"line {number + e.lineno - 1}, column {e.colno}"
        what, pos = f"{e.msg}: line {e.lineno} column {e.colno} (char {e.pos})", e.pos
    elif isinstance(e, UnicodeDecodeError):  # json.loads decodes the bytes first
        where = f"line {number}, byte {e.start + 1}"
        what, pos = f"not UTF-8 ({e.reason})", len(line[: e.start].decode("utf-8", errors="replace"))
    else:
        where, what, pos = f"line {number}", str(e), 0
    near = text[max(0, pos - 30) : pos + 30]
    return (
        f"{path}:{number}: not valid JSON at {where}: {what}; near {near!r}; fix or delete that line (every "
        "non-blank line of a JSONL file is one JSON object)"
    )


def _lines(path: str, start: int, stop: int) -> list[tuple[int, bytes]]:
    """(offset, line) of the non-blank lines that start in [start, stop)."""
    out = []
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # to the first line start >= start
        pos = f.tell()
        while pos < stop:
            line = f.readline()
            if not line:
                break
            if line.strip():
                out.append((pos, line))
            pos += len(line)
    return out


def _previous_line_blank(f, pos: int) -> bool:
    """Whether the line that ends just before ``pos`` (a line start) holds only whitespace."""
    end = pos - 1  # the '\n' that ends the previous line
    while end > 0:
        begin = max(0, end - 4096)
        f.seek(begin)
        block = f.read(end - begin)
        cut = block.rfind(b"\n")
        if block[cut + 1 :].strip():
            return False
        if cut >= 0:
            return True
        end = begin
    return True


def _paragraphs(path: str, start: int, stop: int) -> list[tuple[int, bytes]]:
    """(offset, text) of the paragraphs (runs of non-blank lines) that start in [start, stop)."""
    out: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()
        pos = f.tell()
        inside = pos > 0 and not _previous_line_blank(f, pos)  # in a paragraph that started before `start`
        f.seek(pos)
        current: list[bytes] | None = None
        first = 0
        for line in f:
            if pos >= stop and current is None:
                break
            if not line.strip():
                if current is not None:
                    out.append((first, b"".join(current).rstrip()))
                    current = None
                inside = False
            elif not inside:
                current, first, inside = [line], pos, True
            elif current is not None:
                current.append(line)
            pos += len(line)
        if current is not None:
            out.append((first, b"".join(current).rstrip()))
    return out


# ----------------------------------------------------------------------------------------------- parquet
def import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            'reading parquet needs pyarrow, which is not installed: pip install -e ".[parquet]" (or pip install '
            "pyarrow), or convert the data with scripts/prepare_data.py on a machine that has it"
        ) from None
    return pq


class ParquetSource(RawSource):
    """One document per row of ``column``; a unit is a row group (read whole, one column)."""

    def __init__(self, files: Sequence[str], column: str = "text", where: str = ""):
        pq = import_pyarrow_parquet()
        self.files, self.column = list(files), column
        self.groups: list[tuple[int, int]] = []  # (file, row group)
        self.rows = 0
        for fi, path in enumerate(self.files):
            try:
                pf = pq.ParquetFile(path)
            except Exception as e:  # pyarrow raises ArrowInvalid and friends
                raise DataError(f"{path} is not a readable parquet file ({e})") from None
            if column not in pf.schema_arrow.names:
                raise DataError(
                    f"{path}: no column {column!r} (it has {pf.schema_arrow.names}); set the dataset field to the "
                    "column that holds the text"
                )
            self.groups += [(fi, rg) for rg in range(pf.num_row_groups)]
            self.rows += pf.metadata.num_rows
        self.description = describe_files(self.files, where, "parquet")

    def __len__(self) -> int:
        return len(self.groups)

    def identity(self) -> tuple:
        return ("parquet", self.column, _stat_identity(self.files))

    def counted_documents(self) -> int | None:
        return self.rows

    def texts(self, u: int) -> list[str]:
        pq = import_pyarrow_parquet()
        fi, rg = self.groups[u]
        values = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=[self.column]).column(0).to_pylist()
        return [v if isinstance(v, str) else str(v) for v in values if v is not None and v != ""]


# ------------------------------------------------------------------------------------------ HF datasets
class HFDatasetSource(RawSource):
    """Rows of a local dataset that the Hugging Face ``datasets`` library reads (a ``save_to_disk`` folder, or
    files / a folder ``load_dataset`` understands), ``rows_per_unit`` rows a unit. For prepare_data.py."""

    def __init__(self, path: str, field: str = "text", hf_split: str = "train", rows_per_unit: int = 1000):
        try:
            import datasets
        except ImportError:
            raise DataError(
                "reading a Hugging Face dataset needs the `datasets` library: pip install datasets"
            ) from None
        if not os.path.exists(path):
            raise DataError(f"{path} does not exist; give the folder or files of a local dataset")
        try:
            if os.path.isfile(os.path.join(path, "dataset_info.json")) or os.path.isfile(
                os.path.join(path, "state.json")
            ):
                ds = datasets.load_from_disk(path)
            else:
                ds = datasets.load_dataset(path, split=hf_split)
        except Exception as e:  # datasets raises many kinds
            raise DataError(f"{path}: the datasets library cannot read it ({type(e).__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if hf_split not in ds:
                raise DataError(f"{path}: no split {hf_split!r} (it has {sorted(ds)})")
            ds = ds[hf_split]
        if field not in ds.column_names:
            raise DataError(f"{path}: no column {field!r} (it has {ds.column_names}); set --dataset-field")
        self.ds, self.field, self.per_unit = ds, field, rows_per_unit
        self.description = f"the dataset at {path} ({len(ds)} rows)"

    def __len__(self) -> int:
        return -(-len(self.ds) // self.per_unit)

    def identity(self) -> tuple:
        return ("hf", self.description, self.field, self.per_unit)

    def counted_documents(self) -> int | None:
        return len(self.ds)

    def texts(self, u: int) -> list[str]:
        values = self.ds[u * self.per_unit : (u + 1) * self.per_unit][self.field]
        return [v if isinstance(v, str) else str(v) for v in values if v is not None and v != ""]


# --------------------------------------------------------------------------------------------- building
def chunk_bytes_for(files: Sequence[str], min_units: int) -> int:
    """A byte-range size that gives about ``min_units`` units over ``files``, within [4 KiB, 1 MiB]."""
    total = sum(os.path.getsize(f) for f in files)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, total // max(1, min_units)))


def build_raw_source(
    dataset: str,
    dataset_path: str = "",
    dataset_field: str = "text",
    *,
    text_documents: str = "blank_line",
    min_units: int = 64,
) -> RawSource:
    """``stdlib`` (offline default, path ignored, one document per file), ``text`` (.txt/.md: a document per
    paragraph, or per file with ``text_documents="file"``), ``jsonl`` (``dataset_field`` of each line) or
    ``parquet`` (column ``dataset_field``). Byte-range units are sized to give about ``min_units`` of them."""
    if dataset == "stdlib":
        return stdlib_source()
    files = raw_files(dataset, dataset_path)
    if dataset == "parquet":
        return ParquetSource(files, dataset_field or "text", dataset_path)
    if dataset == "text" and text_documents == "file":
        return FileSource(files, describe_files(files, dataset_path, "text"))
    if dataset == "text" and text_documents != "blank_line":
        raise DataError(f"text_documents must be one of {TEXT_DOCUMENTS}, got {text_documents!r}")
    kind = "jsonl" if dataset == "jsonl" else "paragraphs"
    return RecordSource(files, kind, dataset_field or "text", chunk_bytes_for(files, min_units), dataset_path)


def raw_files(dataset: str, dataset_path: str) -> list[str]:
    """The files of a ``text``, ``jsonl`` or ``parquet`` dataset at ``dataset_path``; ``DataError`` naming the path
    when there are none (also what a launch checks before its start-up, titan_dmuon/preflight.py)."""
    if dataset not in _SUFFIXES:
        raise DataError(f"unknown dataset kind {dataset!r}; choose one of {RAW_DATASETS} or 'tokens'")
    if not dataset_path:
        raise DataError(f"dataset {dataset!r} needs a dataset path (a file, a folder or a glob)")
    return list_files(dataset_path, _SUFFIXES[dataset])


def iter_documents(source: RawSource, max_docs: int | None = None) -> Iterator[str]:
    """The documents of ``source`` (of its split, if set) in unit order, e.g. to train a tokenizer on."""
    n = 0
    for u in range(len(source)):
        for text in source.documents(u):
            if max_docs is not None and n >= max_docs:
                return
            n += 1
            yield text
