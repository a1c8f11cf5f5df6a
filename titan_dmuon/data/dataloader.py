"""The training/validation dataloader: a ``StatefulDataLoader`` over the packed, DP-sharded token stream."""

from __future__ import annotations

import logging
import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from .datasets import PackedDataset, build_source

logger = logging.getLogger(__name__)


def build_dataset(
    *,
    dataset: str,
    dataset_path: str,
    dataset_field: str,
    tokenizer,
    dp_rank: int,
    dp_world_size: int,
    seq_len: int,
    split: str = "train",
    seed: int = 0,
    shuffle: bool | None = None,
    val_fraction: float = 0.02,
) -> PackedDataset:
    """The packed stream of one split for one DP rank (see ``PackedDataset``)."""
    source = build_source(dataset, dataset_path, dataset_field)
    ds = PackedDataset(
        source,
        tokenizer,
        seq_len,
        dp_rank,
        dp_world_size,
        split=split,
        seed=seed,
        shuffle=shuffle,
        val_fraction=val_fraction,
    )
    logger.info(
        "Dataset %s (%s split): %d of %d documents, seq_len %d, DP rank %d/%d",
        dataset,
        split,
        ds.num_docs,
        len(source),
        seq_len,
        dp_rank,
        dp_world_size,
    )
    return ds


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str,
    dataset_field: str,
    tokenizer,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    split: str = "train",
    seed: int = 0,
    shuffle: bool | None = None,
    val_fraction: float = 0.02,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """Yields ``(inputs, labels)``, both ``LongTensor[local_batch_size, seq_len]``; labels are inputs shifted
    by one. TP/CP ranks of one DP group pass the same ``dp_rank`` and get identical batches. ``shuffle``
    defaults to True for "train" (document order reseeded by ``seed`` each epoch) and False for "val".
    ``loader.state_dict()`` / ``load_state_dict()`` resume the stream exactly."""
    ds = build_dataset(
        dataset=dataset,
        dataset_path=dataset_path,
        dataset_field=dataset_field,
        tokenizer=tokenizer,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seq_len=seq_len,
        split=split,
        seed=seed,
        shuffle=shuffle,
        val_fraction=val_fraction,
    )
    with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital in __init__
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
        return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=num_workers)
