"""What a launch checks before its start-up: the paths a config names (data, tokenizer, the weights to start from).

A run's start-up (importing torch, the process group, the meta model) takes seconds on one process and more under
torchrun; a mistyped path found only then costs them each time. These checks read the file system alone, import
neither torch nor the model code, and raise the ConfigError the trainer would (one line, exit 2). The trainer's own
checks stay where they are (they also read the data's contents); this only finds the missing paths sooner.

    python -m titan_dmuon.preflight --config X.toml [--section.field value ...]

is what the launchers (run_train.sh, scripts/multinode_trainer.slurm) run once before torchrun: a bad flag or path
is then one line, exit 2, before any rank or rendezvous exists.
"""

from __future__ import annotations

import os
import sys

from titan_dmuon.config import ConfigError, JobConfig


def check_paths(cfg: JobConfig) -> None:
    """ConfigError naming the field and the path for the first path of `cfg` that is missing (a dry run plans
    another machine's run: its paths are not this machine's to check)."""
    from titan_dmuon.data.errors import DataError
    from titan_dmuon.data.shards import read_manifest
    from titan_dmuon.data.sources import raw_files
    from titan_dmuon.data.tokenizer import check_tokenizer_path

    def dataset(field: str, kind: str, path: str) -> None:
        if kind == "stdlib":
            return
        try:
            read_manifest(path) if kind == "tokens" else raw_files(kind, path)
        except DataError as e:
            raise ConfigError(f"{field}: {e}") from None

    if cfg.job.dry_run:
        return
    t, v = cfg.training, cfg.validation
    try:
        check_tokenizer_path(cfg.model.tokenizer)
    except DataError as e:
        raise ConfigError(f"model.tokenizer: {e}") from None
    dataset("training.dataset_path", t.dataset, t.dataset_path)
    own = v.own_dataset(t)
    if v.enable and own is not None:
        dataset("validation.dataset_path", *own)
    path = cfg.checkpoint.initial_load_path
    if path and not os.path.isdir(path):
        raise ConfigError(
            f"checkpoint.initial_load_path: {path} is not a folder: give a checkpoint's step-N folder or a Hugging "
            "Face folder (config.json and *.safetensors)"
        )


def main(argv: list[str]) -> int:
    """Parse `argv` as train.py does and check its paths: 0, or exit 2 with the config error, printed once."""
    from titan_dmuon.config import parse_args_or_exit

    parse_args_or_exit(argv, check=check_paths)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
