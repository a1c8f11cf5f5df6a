"""Up-front checks of a dataset: everything that would otherwise fail mid-run, found before the model is built.

Token shards are checked from their manifest (files present with the sizes it lists, the same tokenizer, ids
that fit the dtype). A raw source is read once: each rank of the job reads every ``world``-th unit (so the job
reads the corpus once, not once per rank), counts the documents of each split and stops at the first one that
does not parse; the ranks then exchange what they found, and every rank raises the same ``DataError`` (the
first bad unit's file and line) or none. Parquet is checked from its metadata (columns, row counts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from .errors import DataError
from .shards import TokenSource
from .sources import RawSource, in_val_split


@dataclass
class Census:
    """What reading a raw source found: documents per split, and the first unit that failed."""

    documents: int = 0
    val_documents: int | None = 0  # None: not counted (parquet's metadata says how many rows, not which)
    error_unit: int | None = None
    error: str = ""

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
        )


def take_census(source: RawSource, val_fraction: float, rank: int = 0, world: int = 1) -> Census:
    """Read units ``rank, rank + world, ...`` of ``source``; stop at the first that raises ``DataError``."""
    counted = source.counted_documents()
    if counted is not None:
        return Census(counted if rank == 0 else 0, None)
    census = Census()
    for u in range(rank, len(source), world):
        try:
            texts = source.texts(u)
        except DataError as e:
            return Census(census.documents, census.val_documents, u, str(e))
        census.documents += len(texts)
        census.val_documents += sum(in_val_split(t, val_fraction) for t in texts)
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
        _check_counts(source, census, split)
    return source


def _check_counts(source: RawSource, census: Census, split: str) -> None:
    if census.error:
        raise DataError(census.error)
    if census.documents == 0:
        raise DataError(f"{source.description}: no documents (empty or blank); nothing to train on")
    if census.val_documents is None or split not in ("train", "val"):
        return
    count = census.val_documents if split == "val" else census.documents - census.val_documents
    if count == 0:
        raise DataError(
            f"{source.description}: the {split} split is empty: {census.val_documents} of {census.documents} "
            f"documents are held out for validation (val_fraction {source.val_fraction}); "
            + (
                "add documents, or give validation a dataset of its own (validation.dataset)"
                if split == "val"
                else "add documents"
            )
        )
