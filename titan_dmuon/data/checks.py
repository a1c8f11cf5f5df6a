"""Up-front checks of a dataset: everything that would otherwise fail mid-run, found before the model is built.

Token shards are checked from their manifest (files present with the sizes it lists, the same tokenizer, ids
that fit the dtype). A raw source is read once: each rank of the job reads every ``world``-th unit (so the job
reads the corpus once, not once per rank), counts the documents of each split and stops at the first one that
does not parse; the ranks then exchange what they found, and every rank raises the same ``DataError`` (the
first bad unit's file and line) or none. Parquet is checked from its metadata (columns, row counts), unless it
is small enough for the hash split to come out empty (then it is read like the others).

The census also keeps the lowest and highest CRC32 of a document's text, which is all it takes to repair the
hash split of a small corpus the same way on every rank (``Census.split_bound``): when ``val_fraction`` in
(0, 1) would hold out none of two or more documents, the documents with the lowest CRC32 are held out; when it
would hold out all of them, those with the highest stay in train.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from .errors import DataError
from .shards import TokenSource
from .sources import RawSource, text_crc

logger = logging.getLogger(__name__)

# Below this many expected documents on the smaller side of the split, a corpus whose metadata counts its rows
# (parquet) is read anyway: the hash split of n documents is empty with probability (1 - f)^n ~ exp(-f n).
SMALL_SPLIT = 30


def _extreme(a: tuple[int, int] | None, b: tuple[int, int] | None, lowest: bool) -> tuple[int, int] | None:
    """The lower (or higher) of two (CRC32, documents with it); the counts add up on a tie."""
    if a is None or b is None:
        return a if b is None else b
    if a[0] == b[0]:
        return (a[0], a[1] + b[1])
    return a if (a[0] < b[0]) == lowest else b


@dataclass
class Census:
    """What reading a raw source found: documents per split, the lowest and highest CRC32 of a document's
    text (each with how many documents have it), and the first unit that failed."""

    documents: int = 0
    val_documents: int | None = 0  # None: not counted (parquet's metadata says how many rows, not which)
    error_unit: int | None = None
    error: str = ""
    lowest: tuple[int, int] | None = None  # (CRC32, documents with it); None when nothing was read
    highest: tuple[int, int] | None = None

    def merge(self, other: Census) -> Census:
        first = min((c for c in (self, other) if c.error_unit is not None), key=lambda c: c.error_unit, default=None)
        val = (
            None
            if self.val_documents is None or other.val_documents is None
            else self.val_documents + other.val_documents
        )
        return Census(
            self.documents + other.documents,
            val,
            first.error_unit if first else None,
            first.error if first else "",
            _extreme(self.lowest, other.lowest, lowest=True),
            _extreme(self.highest, other.highest, lowest=False),
        )

    def split_bound(self, val_fraction: float) -> tuple[float | None, int | None]:
        """The CRC32 bound below which a document is held out, and how many documents that holds out.

        The hash rule's bound (``val_fraction`` of the hash range; returned as None) unless, with
        ``0 < val_fraction < 1``, it would hold out none of two or more documents (then the bound sits just above
        the lowest CRC32: the documents with that text are held out, and no others) or all of them (then it is
        the highest CRC32: the documents with that text stay in train, or all of them when every document has
        the same CRC32, one document included). Which documents are held out depends on their texts only, so it
        is the same on every rank and in every run; a corpus the hash rule splits keeps exactly that split.
        """
        val, n = self.val_documents, self.documents
        if val is None or not 0 < val_fraction < 1 or n == 0 or self.lowest is None or self.highest is None:
            return None, val
        (low, at_low), (high, at_high) = self.lowest, self.highest
        if val == 0 and n >= 2 and low != high:
            return low + 1, at_low
        if val == n:
            return (high, n - at_high) if low != high else (low, 0)
        return None, val


def take_census(source: RawSource, val_fraction: float, rank: int = 0, world: int = 1) -> Census:
    """Read units ``rank, rank + world, ...`` of ``source``; stop at the first that raises ``DataError``."""
    counted = source.counted_documents()
    if counted is not None and not (
        0 < val_fraction < 1 and counted * min(val_fraction, 1 - val_fraction) < SMALL_SPLIT
    ):
        return Census(counted if rank == 0 else 0, None)
    census = Census()
    bound = val_fraction * 2**32
    for u in range(rank, len(source), world):
        try:
            texts = source.texts(u)
        except DataError as e:
            return Census(census.documents, census.val_documents, u, str(e), census.lowest, census.highest)
        crcs = [text_crc(t) for t in texts]
        census.documents += len(crcs)
        census.val_documents += sum(c < bound for c in crcs)
        if crcs:
            low, high = min(crcs), max(crcs)
            census.lowest = _extreme(census.lowest, (low, crcs.count(low)), lowest=True)
            census.highest = _extreme(census.highest, (high, crcs.count(high)), lowest=False)
    return census


_CENSUS: dict[tuple, Census] = {}  # per source state: the train and validation loaders of a dataset read it once


def checked_source(build: Callable[[], RawSource | TokenSource], tokenizer, split: str) -> RawSource | TokenSource:
    """``build()`` the source of ``split`` and check it, on every rank of the process group together (when one
    with several ranks is up): each rank builds, checks token shards against ``tokenizer`` or reads its share
    of a raw source's units, and one ``all_gather_object`` gives every rank what all found, so every rank
    raises the same ``DataError`` (the lowest rank's, or the first bad unit's file and line) or none, even
    when only one rank could not read a file. Returns the source."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    source, census, key, error = None, None, None, ""
    try:
        source = build()
        if isinstance(source, TokenSource):
            source.check_tokenizer(tokenizer)
        elif len(source) == 0:
            raise DataError(f"{source.description}: empty (0 bytes); nothing to train on")
        else:
            key = (source.identity(), source.val_fraction)
            census = _CENSUS.get(key) or take_census(source, source.val_fraction, rank, world)
    except DataError as e:
        error = str(e)
    if distributed:
        reports: list[tuple[str, Census | None] | None] = [None] * world
        dist.all_gather_object(reports, (error, census))
        error = next((e for e, _ in reports if e), "")
        if not error and key is not None and key not in _CENSUS:  # raw: add up the ranks' shares
            census = Census(0, 0)
            for _, c in reports:
                census = census.merge(c)
    if error:
        raise DataError(error)
    if key is not None:
        _CENSUS[key] = census
        source.val_threshold, val = census.split_bound(source.val_fraction)
        if source.val_threshold is not None and val and split == "val":
            logger.info(
                "%s: val_fraction %s holds out %d of %d documents by the text hash; holding out %d instead (a "
                "split holds out at least one of two or more documents, and never all)",
                source.description,
                source.val_fraction,
                census.val_documents,
                census.documents,
                val,
            )
        _check_counts(source, census, split, val)
    return source


def _check_counts(source: RawSource, census: Census, split: str, val: int | None) -> None:
    if census.error:
        raise DataError(census.error)
    if census.documents == 0:
        raise DataError(f"{source.description}: no documents (empty or blank); nothing to train on")
    if val is None or split not in ("train", "val"):
        return
    count = val if split == "val" else census.documents - val
    if count == 0:
        why = f"{val} of {census.documents} documents are held out for validation"
        if split == "val" and census.documents == 1:
            why = "one document cannot be split (it stays in the train split)"
        elif split == "val" and 0 < source.val_fraction < 1:
            why = f"all {census.documents} documents have the same text, so they stay on one side"
        raise DataError(
            f"{source.description}: the {split} split is empty: {why} (val_fraction {source.val_fraction}); "
            + (
                "add documents, or give validation a dataset of its own (validation.dataset)"
                if split == "val"
                else "add documents"
            )
        )
