"""The training/validation dataloader: a DP rank's share of the global batches, checked up front, read by a
torchdata ``StatefulDataLoader`` (optionally with worker processes) and batched into micro-batches."""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from .checks import check_source
from .errors import DataError
from .packing import PackedDataset
from .shards import TokenSource
from .sources import RAW_DATASETS, RawSource, build_raw_source

logger = logging.getLogger(__name__)

DATASETS = (*RAW_DATASETS, "tokens")
VAL_FRACTION = 0.02


def build_source(
    dataset: str,
    dataset_path: str = "",
    dataset_field: str = "text",
    *,
    split: str = "train",
    val_fraction: float = VAL_FRACTION,
    text_documents: str = "blank_line",
    min_units: int = 64,
) -> RawSource | TokenSource:
    """The documents of ``split`` ("train" or "val") of a dataset: token shards (``tokens``: the folder's split;
    with ``val_fraction >= 1``, every document of both splits, as for a dataset given to validation whole) or a
    raw source whose documents are assigned to a split by ``val_fraction``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if dataset == "tokens":
        if not dataset_path:
            raise DataError("dataset 'tokens' needs a dataset path: the folder scripts/prepare_data.py wrote")
        return TokenSource(dataset_path, ("train", "val") if split == "val" and val_fraction >= 1 else (split,))
    source = build_raw_source(dataset, dataset_path, dataset_field, text_documents=text_documents, min_units=min_units)
    source.split, source.val_fraction = split, val_fraction
    return source


class MicroBatchLoader:
    """``local_batch_size`` consecutive windows of a rank's stream as one micro-batch ``(inputs, labels)``,
    both ``LongTensor[local_batch_size, seq_len]`` (pinned when ``pin_memory``). Batching happens here, not
    in the workers, so that the workers can split the rows of one micro-batch between them."""

    def __init__(self, loader: StatefulDataLoader, local_batch_size: int, pin_memory: bool = False):
        self.loader, self.local_batch_size, self.pin_memory = loader, local_batch_size, pin_memory
        self.dataset: PackedDataset = loader.dataset

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        windows = iter(self.loader)
        while True:
            batch = list(itertools.islice(windows, self.local_batch_size))
            if len(batch) < self.local_batch_size:
                return
            stacked = torch.stack(batch)
            inputs, labels = stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()
            if self.pin_memory:
                inputs, labels = inputs.pin_memory(), labels.pin_memory()
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str = "",
    dataset_field: str = "text",
    tokenizer,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    global_batch_size: int | None = None,
    split: str = "train",
    seed: int = 0,
    shuffle: bool = True,
    val_fraction: float = VAL_FRACTION,
    text_documents: str = "blank_line",
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> MicroBatchLoader:
    """This DP rank's micro-batches of the global batches of ``global_batch_size`` rows (default
    ``local_batch_size x dp_world_size``; with gradient accumulation, times the micro-batches per step: the
    rank's ``global_batch_size / dp_world_size`` rows of a step come as that many micro-batches in order).

    TP/CP ranks of one DP group pass the same ``dp_rank`` and get identical batches. The dataset is checked
    first (``DataError`` names the file and line; a collective over the process group when one is up).
    Training loops over epochs forever; "val" restarts on every ``iter``. ``state_dict()`` /
    ``load_state_dict()`` resume exactly (with the same ``num_workers``). ``pin_memory`` defaults to CUDA
    being available.
    """
    global_batch_size = global_batch_size or local_batch_size * dp_world_size
    rows, rest = divmod(global_batch_size, dp_world_size)
    if rest or rows % local_batch_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not a multiple of local_batch_size {local_batch_size} x "
            f"{dp_world_size} DP ranks"
        )
    if num_workers < 0:
        raise DataError(f"num_workers must be >= 0, got {num_workers}")
    source = build_source(
        dataset,
        dataset_path,
        dataset_field,
        split=split,
        val_fraction=val_fraction,
        text_documents=text_documents,
        min_units=4 * global_batch_size,
    )
    check_source(source, tokenizer, split)
    ds = PackedDataset(
        source,
        tokenizer,
        seq_len,
        global_batch_size,
        dp_rank,
        dp_world_size,
        seed=seed,
        shuffle=shuffle,
        restart_on_iter=split == "val",
    )
    logger.info(
        "Data (%s): %s, %d units; global batch %d x %d tokens, DP rank %d/%d reads %d rows, %d workers",
        split,
        source.description,
        len(source),
        global_batch_size,
        seq_len,
        dp_rank,
        dp_world_size,
        rows,
        num_workers,
    )
    if num_workers:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital in __init__
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
        loader = StatefulDataLoader(
            ds,
            batch_size=None,
            num_workers=num_workers,
            # about two micro-batches in flight per worker
            prefetch_factor=max(2, 2 * -(-local_batch_size // num_workers)) if num_workers else None,
        )
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return MicroBatchLoader(loader, local_batch_size, pin)
