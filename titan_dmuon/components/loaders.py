"""The job's two data loaders from its config, through one `build_dataloader` call so that the training split and
the held-out validation data are read the same way (one tokenizer, seed, sequence length, workers)."""

from __future__ import annotations

from typing import Literal

import torch

from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.data import VAL_FRACTION, DataError, MicroBatchLoader, Tokenizer, build_dataloader


def global_batch_size(cfg: JobConfig, dp_world_size: int) -> int:
    """Rows of one optimizer step over every DP rank: local x DP x accumulation."""
    t = cfg.training
    return t.local_batch_size * dp_world_size * t.gradient_accumulation_steps


def build_job_dataloader(
    cfg: JobConfig,
    split: Literal["train", "val"],
    *,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    device: torch.device,
) -> MicroBatchLoader:
    """This DP rank's loader of `split`: "train" reads the training data but its held-out VAL_FRACTION, in global
    batches of `global_batch_size` rows; "val" reads validation.dataset whole when set, else that held-out
    VAL_FRACTION. Bad data is a ConfigError (checked before the model is built, the same on every rank)."""
    t, v = cfg.training, cfg.validation
    dataset, path, fraction = t.dataset, t.dataset_path, VAL_FRACTION
    own = v.own_dataset(t)
    if split == "val" and own is not None:  # a dataset of its own: all of it is validation data
        (dataset, path), fraction = own, 1.0
    batch = global_batch_size(cfg, dp_world_size) if split == "train" else None  # val: local x DP rows
    what = "training data" if split == "train" else "validation data"
    try:
        return build_dataloader(
            dataset=dataset,
            dataset_path=path,
            dataset_field=t.dataset_field,
            tokenizer=tokenizer,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            local_batch_size=t.local_batch_size,
            seq_len=t.seq_len,
            global_batch_size=batch,
            split=split,
            seed=seed,
            val_fraction=fraction,
            text_documents=t.text_documents,
            num_workers=t.num_workers,
            pin_memory=device.type == "cuda",
        )
    except DataError as e:
        raise ConfigError(f"{what}: {e}") from None


__all__ = ["build_job_dataloader", "global_batch_size"]
