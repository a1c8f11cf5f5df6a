"""The training/validation dataloader: a DP rank's share of the global batches, checked up front, read by a
torchdata ``StatefulDataLoader`` (optionally with worker processes) and batched into micro-batches."""

from __future__ import annotations

import logging
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from .checks import checked_source
from .errors import DataError
from .packing import PackedDataset, interleave
from .shards import TokenSource
from .sources import RAW_DATASETS, RawSource, build_raw_source

logger = logging.getLogger(__name__)

DATASETS = (*RAW_DATASETS, "tokens")
VAL_FRACTION = 0.02


def _worker_context() -> multiprocessing.context.BaseContext | None:
    """Workers start from a forkserver, not by forking the trainer: the trainer has threads by the time a loader
    starts (gloo/NCCL, an async checkpoint save, torch.compile's pools; a validation loader restarts its workers
    at every evaluation), and a fork copies whatever lock those threads held, so a forked worker can hang or
    crash. The server imports the data package once, so each worker still starts in milliseconds."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None  # Windows: the default (spawn) is already clean
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["titan_dmuon.data"])
    return ctx


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
    """A rank's micro-batches ``(inputs, labels)``, both ``LongTensor[local_batch_size, seq_len]`` (pinned when
    ``pin_memory``): each step's rows (one item per worker, put back in row order) cut into consecutive
    micro-batches. ``state_dict()`` is exact between any two micro-batches, also inside a step."""

    def __init__(self, loader: StatefulDataLoader, local_batch_size: int, pin_memory: bool = False):
        self.loader, self.local_batch_size, self.pin_memory = loader, local_batch_size, pin_memory
        self.dataset: PackedDataset = loader.dataset
        self.workers = max(1, loader.num_workers)
        self._before: dict[str, Any] | None = None  # the loader's state before the current step
        self._served = self._per_step = 0  # micro-batches of the current step yielded, and in all
        self._skip = 0  # micro-batches of the first step to skip after a resume inside a step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        items = iter(self.loader)
        skip, self._skip = self._skip, 0
        while True:
            before = self.loader.state_dict()
            try:
                windows = torch.from_numpy(interleave([next(items) for _ in range(self.workers)]))
            except StopIteration:
                return
            self._before, self._per_step = before, len(windows) // self.local_batch_size
            for m in range(skip, self._per_step):
                self._served = m + 1
                batch = windows[m * self.local_batch_size : (m + 1) * self.local_batch_size]
                inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
                if self.pin_memory:
                    inputs, labels = inputs.pin_memory(), labels.pin_memory()
                yield inputs, labels
            skip = 0

    def state_dict(self) -> dict[str, Any]:
        if 0 < self._served < self._per_step:  # inside a step: replay it, skipping what was served
            return {"loader": self._before, "served": self._served}
        return {"loader": self.loader.state_dict(), "served": self._skip}  # (a loaded state not yet iterated)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self._skip, self._served = state["served"], 0

    # The global position: what a checkpoint stores, so that any DP size with the same global batch resumes it
    # (the per-rank state above holds DataLoader internals that only the same ranks and workers can take back).
    @property
    def rows(self) -> list[int]:
        """The global batch rows this rank reads."""
        return self.dataset.rows

    def position(self) -> dict[str, Any]:
        """At a step boundary: ``{"step": steps served, "rows": {global row: [unit, document, token]}}`` for this
        rank's rows. Each row's reader lives in the worker that packs it (row ``i`` of the rank: worker ``i % W``)."""
        if 0 < self._served < self._per_step:
            raise RuntimeError("the data position is defined between steps only, not inside one")
        state = self.loader.state_dict()
        if "_snapshot" in state:  # worker processes: each holds its rows' readers
            workers = state["_snapshot"].get("_worker_snapshots") or {}
            dataset_states = [workers.get(f"worker_{w}", {}).get("dataset_state") for w in range(self.workers)]
        else:
            dataset_states = [state.get("dataset_state")]
        if any(s is None for s in dataset_states):  # not iterated yet: the dataset object holds the position
            dataset_states = [self.dataset.state_dict()] * len(dataset_states)
        rows = {j: list(dataset_states[i % len(dataset_states)]["rows"][i]) for i, j in enumerate(self.rows)}
        return {"step": int(dataset_states[0]["step"]), "rows": rows}

    def seek(self, step: int, rows: dict[int, list[int]]) -> None:
        """Continue from a `position()` (of any DP layout of the same global batch): this rank's rows' positions.
        Call before the first ``iter``: the fresh loader hands the dataset (and its workers) this state."""
        self.dataset.load_state_dict({"step": step, "rows": [rows[j] for j in self.rows]})
        self._skip = self._served = 0


def _as_is(item):
    return item


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
    source = checked_source(
        lambda: build_source(
            dataset,
            dataset_path,
            dataset_field,
            split=split,
            val_fraction=val_fraction,
            text_documents=text_documents,
            min_units=4 * global_batch_size,
        ),
        tokenizer,
        split,
    )
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
            batch_size=None,  # an item is a step's rows (a worker's share of them)
            collate_fn=_as_is,
            num_workers=num_workers,
            multiprocessing_context=_worker_context() if num_workers else None,
            prefetch_factor=2 if num_workers else None,  # two steps in flight per worker
            # each iterator draws its base seed from this generator, not from torch's global one: a resumed run
            # restores the global generator before its first batch, which must not draw from it again
            generator=torch.Generator().manual_seed(seed),
        )
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return MicroBatchLoader(loader, local_batch_size, pin)
