"""The start of a run: every layout builds on meta, each rank materializes only its share, and the initial
weights are bitwise the same on 1 process, FSDP 4, HSDP 2x2, dp2 x tp2 and 2 x 2 x 2 (values are a function
of (seed, FQN) only: titan_dmuon/components/initialization.py).

The Trainer's own build runs in each rank (tests/_dist.py); the full state dict is gathered in-process. A small
init tile (8 x 16) makes every matrix span several tiles, so shards start and end inside tiles.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.train_runs import tiny_train_argv

TILE = (8, 16)
LAYOUTS = {
    "fsdp4": [],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    "dp2xtp2": ["--parallelism.tensor_parallel_degree", "2"],
    "dp2xtp2-adamw": ["--parallelism.tensor_parallel_degree", "2", "--optimizer.name", "adamw"],
}


def _argv(dump: str, extra: list[str]) -> list[str]:
    return tiny_train_argv(dump, *extra)


def initial_weights(argv: list[str]) -> dict[str, torch.Tensor]:
    """Build the Trainer (model, parallelism, materialization, optimizer) and return the full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import titan_dmuon.components.initialization
    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    tile, titan_dmuon.components.initialization.TILE = titan_dmuon.components.initialization.TILE, TILE
    trainer = None
    try:
        trainer = Trainer(parse_args(argv))
        if trainer.cfg.optimizer.name == "dmuon":
            return dmuon.get_model_state_dict(trainer.model)
        return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    finally:
        titan_dmuon.components.initialization.TILE = tile
        if trainer is not None:
            trainer.close()


def _layouts(rank: int, world_size: int, dump: str, layouts: dict[str, list[str]]) -> dict | None:
    out = {name: initial_weights(_argv(f"{dump}/{name}", extra)) for name, extra in layouts.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    return initial_weights(_argv(str(tmp_path_factory.mktemp("one")), []))


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], layout: str) -> None:
    assert sorted(got) == sorted(want), layout
    for key in want:
        assert torch.equal(got[key], want[key]), f"{layout}: {key} differs from the 1-process start"


@pytest.mark.slow
def test_four_ranks_start_bitwise_like_one_process(tmp_path, reference) -> None:
    (got, *_) = run_distributed(_layouts, 4, str(tmp_path), LAYOUTS)
    for name in LAYOUTS:
        _assert_bitwise(got[name], reference, name)
    assert not torch.equal(reference["layers.0.attention.wq.weight"], reference["layers.1.attention.wq.weight"])


@pytest.mark.slow
def test_eight_ranks_2x2x2_start_bitwise_like_one_process(tmp_path, reference) -> None:
    layout = {
        "2x2x2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    }
    (got, *_) = run_distributed(_layouts, 8, str(tmp_path), layout)
    _assert_bitwise(got["2x2x2"], reference, "2x2x2")


def test_one_process_start_is_init_weights_after_manual_seed(reference, monkeypatch) -> None:
    """The trainer's start equals the family's unsharded init_weights after torch.manual_seed(seed)."""
    import titan_dmuon.components.initialization
    from titan_dmuon.models.llama3 import build_model

    monkeypatch.setattr(titan_dmuon.components.initialization, "TILE", TILE)
    torch.manual_seed(7)
    model = build_model("tinymodel", vocab_size=258, device="cpu", max_seq_len=32)
    _assert_bitwise(model.state_dict(), reference, "init_weights")
