"""Checkpoint integrity: every step folder's `checksums.json`, written when the step is committed and checked before a
run resumes from it (manager.py, which uses this module; the names in a step folder: folder.py).

The manifest holds each file's size and its blocks, one after the other: each block's length and CRC32.

    {"version": 1, "algorithm": "crc32",
     "files": {"__0_0.distcp": {"size": 411264, "blocks": [[1103, 2941538216], [6811, 101224597], ...]},
               ".metadata": {...}, "config.toml": {...}}}

A block is at most `BLOCK_BYTES` long, and the data files' blocks start where DCP's items start (DCP asks the stream
for its position before and after writing each item: that is where a block is cut), so each item is a whole number
of blocks: a rank that loads an item checks exactly its bytes.

Saving. `ChecksummingWriter` is DCP's FileSystemWriter whose streams compute the CRC32s of the bytes as they are
written (no file is read back; `zlib.crc32` releases the GIL, so DCP's writer threads hash in parallel). Each rank's
records ({file: size and blocks}, a few bytes per item) ride to rank 0 in DCP's own gather of the write results (one
extra entry in each rank's list, taken out again before DCP writes `.metadata`): no collective of our own, and no
file of records per rank. Rank 0's `.metadata` is hashed as DCP writes it. At commit, rank 0 writes `checksums.json`
(adding the small files it wrote itself, config.toml and the model_only marker, which it reads back) before the
folder is renamed to `step-<N>`.

Checking. Every file's size is compared with its stat (each rank stats a share of the files); the CRCs are compared
for the blocks holding the bytes that rank will read (DCP's metadata names the file, offset and length of every item
the rank loads), for `.metadata` (which every rank reads in full) and, on rank 0, for the small files. A block that
no rank reads (e.g. another rank's RNG state on a resume with fewer ranks) is not checked: what is loaded is
checked. `verify` checks a whole folder (every block) in one process. Files that the manifest does not list are
ignored (a note a user put there changes nothing that is loaded); a folder without `checksums.json` (saved before
it was kept) reads as unchecked (`read_manifest` returns None).
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import os
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

MANIFEST = "checksums.json"
BLOCK_BYTES = 64 << 20  # the longest block: a CRC32 per item of a data file, and per 64 MiB of a larger one
_VERSION = 1
_RECORDS = "__titan_dmuon_checksums__"  # the fqn of the extra write result that carries a rank's records to rank 0


class DamagedError(Exception):
    """An unreadable manifest: the message says what is wrong."""


@dataclass
class FileDigest:
    """A file's size and its blocks, in order: (length, CRC32) each."""

    size: int
    blocks: list[tuple[int, int]]


@dataclass
class Manifest:
    files: dict[str, FileDigest]


# ------------------------------------------------------------------------------------------ computing
class _Digest:
    """Size and per-block CRC32s of bytes seen in order; a block ends at `cut()` or at `block_bytes`."""

    def __init__(self, block_bytes: int):
        self.block_bytes, self.size = block_bytes, 0
        self.blocks: list[tuple[int, int]] = []
        self._crc, self._fill = 0, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._fill)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._fill += take
            self.size += take
            view = view[take:]
            if self._fill == self.block_bytes:
                self.cut()

    def cut(self) -> None:
        if self._fill:
            self.blocks.append((self._fill, self._crc))
            self._crc, self._fill = 0, 0

    def result(self) -> FileDigest:
        self.cut()
        return FileDigest(self.size, list(self.blocks))


def digest_file(path: str | Path, block_bytes: int | None = None) -> FileDigest:
    """A file's digest read from disk, in blocks of `block_bytes` (for the small files rank 0 writes itself)."""
    digest = _Digest(block_bytes or BLOCK_BYTES)
    buf = bytearray(min(digest.block_bytes, 8 << 20))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(memoryview(buf)[:n])
    return digest.result()


class _DigestingStream:
    """A write stream that hashes what goes through it, starting a block wherever its position is asked for (DCP
    asks before and after each item); a seek makes the file hashed from disk at close. Anything else is the file's."""

    def __init__(self, raw: Any, block_bytes: int):
        self._raw, self.digest, self.sequential = raw, _Digest(block_bytes), True

    def write(self, b: Any) -> int:
        n = self._raw.write(b)
        view = memoryview(b).cast("B")
        n = len(view) if n is None else n
        self.digest.update(view[:n])
        return n

    def tell(self) -> int:
        self.digest.cut()
        return self._raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.sequential = False
        return self._raw.seek(offset, whence)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, closed, ...
        return getattr(self._raw, name)


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, recording the digest of every file written through it (by name in the folder)."""

    def __init__(self, block_bytes: int):
        super().__init__()
        self.block_bytes = block_bytes
        self._digests: dict[str, FileDigest] = {}
        self._lock = threading.Lock()  # DCP's writer threads write files in parallel

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            wrapped = _DigestingStream(stream, self.block_bytes)
            yield wrapped
        digest = wrapped.digest.result() if wrapped.sequential else digest_file(path, self.block_bytes)
        with self._lock:
            self._digests[Path(path).name] = digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self._digests:
                self._digests[Path(new_path).name] = self._digests.pop(Path(path).name)

    def take(self) -> dict[str, FileDigest]:
        """The digests recorded since the last take."""
        with self._lock:
            out, self._digests = self._digests, {}
        return out


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, hashing every file as it writes it; on the coordinator (rank 0) after the save,
    `digests` holds every rank's files and `.metadata` (what `write_manifest` records)."""

    def __init__(self, path: str | os.PathLike, *, block_bytes: int | None = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.block_bytes = block_bytes or BLOCK_BYTES
        self.fs = _DigestingFileSystem(self.block_bytes)
        self.digests: dict[str, FileDigest] | None = None

    def write_data(self, plan, planner):  # this rank's files, then its records as one more write result
        results = list(super().write_data(plan, planner).wait())  # FileSystemWriter's future is done already
        records = {name: (d.size, d.blocks) for name, d in self.fs.take().items()}
        results.append(WriteResult(index=MetadataIndex(_RECORDS), size_in_bytes=0, storage_data=records))
        out: Future = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, FileDigest] = {}
        kept = []
        for rank_results in results:
            mine = []
            for wr in rank_results:
                if wr.index.fqn == _RECORDS:
                    digests.update({n: FileDigest(size, list(blocks)) for n, (size, blocks) in wr.storage_data.items()})
                else:
                    mine.append(wr)
            kept.append(mine)
        super().finish(metadata, kept)  # writes .metadata through self.fs: hashed as written
        digests.update(self.fs.take())
        self.digests = digests


# --------------------------------------------------------------------------------------- the manifest
def write_manifest(folder: str | Path, digests: dict[str, FileDigest], extra: Iterable[str] = ()) -> Path:
    """`folder`'s checksums.json from the writer's digests and those of the `extra` files (read here: small files
    only), fsynced."""
    folder = Path(folder)
    files = dict(digests)
    for name in extra:
        files[name] = digest_file(folder / name)
    record = {
        "version": _VERSION,
        "algorithm": "crc32",
        "files": {name: {"size": d.size, "blocks": [list(b) for b in d.blocks]} for name, d in sorted(files.items())},
    }
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump(record, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    return path


def read_manifest(folder: str | Path) -> Manifest | None:
    """`folder`'s manifest; None when it has none (saved before manifests were kept); DamagedError when unreadable."""
    path = Path(folder) / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DamagedError(f"{MANIFEST} cannot be read ({type(e).__name__}: {e})") from None
    try:
        record = json.loads(text)
        if record.get("version") != _VERSION or record.get("algorithm") != "crc32":
            raise ValueError(f"version {record.get('version')!r}, algorithm {record.get('algorithm')!r}")
        files = {}
        for name, d in record["files"].items():
            blocks = [(int(length), int(crc)) for length, crc in d["blocks"]]
            if any(length <= 0 for length, _ in blocks) or sum(length for length, _ in blocks) != int(d["size"]):
                raise ValueError(f"the blocks of {name} do not add up to its size")
            files[str(name)] = FileDigest(int(d["size"]), blocks)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedError(f"{MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    return Manifest(files)


# ------------------------------------------------------------------------------------------- checking
def check_sizes(folder: str | Path, manifest: Manifest, names: Iterable[str]) -> str | None:
    """The first of `names` whose size on disk differs from the manifest's (one stat each), as a message."""
    for name in names:
        want = manifest.files[name].size
        try:
            got = os.stat(Path(folder) / name).st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read ({type(e).__name__}: {e})"
        if got != want:
            return f"{name} is {got} bytes, {want} expected ({'truncated' if got < want else 'grown since the save'})"
    return None


def blocks_of(digest: FileDigest, ranges: Iterable[tuple[int, int]] | None = None) -> list[tuple[int, int, int]]:
    """(start, length, CRC32) of the file's blocks that hold any of the byte ranges (offset, length); every block
    when `ranges` is None. A range past the end of the file counts as its last block (the size check fails first)."""
    starts = [0, *itertools.accumulate(length for length, _ in digest.blocks)][:-1]
    if ranges is None:
        wanted = range(len(digest.blocks))
    else:
        found: set[int] = set()
        for offset, length in ranges:
            if length <= 0 or not digest.blocks:
                continue
            first = max(bisect.bisect_right(starts, offset) - 1, 0)
            last = max(bisect.bisect_right(starts, offset + length - 1) - 1, 0)
            found.update(range(first, last + 1))
        wanted = sorted(found)
    return [(starts[i], *digest.blocks[i]) for i in wanted]


def check_blocks(
    folder: str | Path, manifest: Manifest, name: str, ranges: Iterable[tuple[int, int]] | None = None
) -> str | None:
    """The CRC32s of `name`'s blocks holding `ranges` (every block when None) against the manifest: None, or the
    first difference as a message. The size is checked first (a stat)."""
    digest = manifest.files.get(name)
    if digest is None:
        return f"{name} is not in {MANIFEST}"
    problem = check_sizes(folder, manifest, [name])
    if problem:
        return problem
    ranges = None if ranges is None else list(ranges)
    if ranges and max(offset + length for offset, length in ranges) > digest.size:
        return f"{name}: DCP's .metadata places data past its recorded size of {digest.size} bytes"
    blocks = blocks_of(digest, ranges)
    buf = bytearray(max((length for _, length, _ in blocks), default=0))
    try:
        with open(Path(folder) / name, "rb", buffering=0) as f:
            for start, length, crc in blocks:
                f.seek(start)
                view = memoryview(buf)[:length]
                got = 0
                while got < length and (n := f.readinto(view[got:])):
                    got += n
                if got < length:
                    return f"{name} is shorter than {digest.size} bytes (truncated while being read)"
                if zlib.crc32(view) != crc:
                    end = start + length - 1
                    return f"{name}: bytes {start}-{end} differ from their checksum (changed since the save)"
    except OSError as e:
        return f"{name} cannot be read ({type(e).__name__}: {e})"
    return None


def verify(folder: str | Path) -> str | None:
    """Every file of a step folder's manifest, every block, in this process: None when intact (or when the folder
    has no manifest: nothing to check it against), else the first damage found as a message."""
    try:
        manifest = read_manifest(folder)
    except DamagedError as e:
        return str(e)
    if manifest is None:
        return None
    names = sorted(manifest.files)
    return check_sizes(folder, manifest, names) or next(
        (p for p in (check_blocks(folder, manifest, n) for n in names) if p), None
    )


__all__ = [
    "BLOCK_BYTES",
    "MANIFEST",
    "ChecksummingWriter",
    "DamagedError",
    "FileDigest",
    "Manifest",
    "blocks_of",
    "check_blocks",
    "check_sizes",
    "digest_file",
    "read_manifest",
    "verify",
    "write_manifest",
]
