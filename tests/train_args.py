"""The train.py arguments the Trainer-level tests share: the Llama-3 tinymodel on the debug config's embedded data,
sequences of 32, no TensorBoard, no heartbeat thread."""

from __future__ import annotations


def tiny_train_argv(dump: str, *extra: str, seed: int = 7) -> list[str]:
    """train.py's arguments for a tinymodel run writing to `dump`, then `extra` (which may override any)."""
    return [
        "--config",
        "train_configs/debug_model.toml",
        "--model.flavor",
        "tinymodel",
        "--training.seq_len",
        "32",
        "--training.seed",
        str(seed),
        "--metrics.enable_tensorboard",
        "false",
        "--comm.heartbeat_seconds",
        "0",
        "--job.dump_folder",
        dump,
        *extra,
    ]
