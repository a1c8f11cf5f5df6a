"""titan_dmuon/checkpoint.py and the data loader's global position, in one process (the train.py runs are in
tests/integration/test_checkpoint.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_dmuon.checkpoint import complete_steps, read_metadata, step_folders, validate_checkpoint_config
from titan_dmuon.config import ConfigError, parse_args
from titan_dmuon.data import build_dataloader, build_tokenizer

GLOBAL_BATCH, LOCAL, SEQ = 8, 2, 16


def _loader(dp_rank: int, dp_world: int, workers: int):
    return build_dataloader(
        dataset="stdlib",
        tokenizer=build_tokenizer("byte"),
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        local_batch_size=LOCAL,
        seq_len=SEQ,
        global_batch_size=GLOBAL_BATCH,
        seed=3,
        num_workers=workers,
    )


def _steps(loader, steps: int) -> list[torch.Tensor]:
    """`steps` global-batch steps of this rank's rows: each step's micro-batches concatenated."""
    it, per_step = iter(loader), GLOBAL_BATCH // loader.dataset.dp_world_size // LOCAL
    return [torch.cat([next(it)[0] for _ in range(per_step)]) for _ in range(steps)]


def _global(parts: list[list[torch.Tensor]], dp_world: int) -> list[torch.Tensor]:
    """Per step, the global batch in row order from the DP ranks' rows (rank r holds rows r, r + N, ...)."""
    out = []
    for step in range(len(parts[0])):
        rows = torch.empty(GLOBAL_BATCH, SEQ, dtype=torch.int64)
        for r in range(dp_world):
            rows[r::dp_world] = parts[r][step]
        out.append(rows)
    return out


@pytest.mark.parametrize(("before", "after"), [((4, 2), (2, 0)), ((2, 0), (1, 1)), ((1, 0), (4, 0))])
def test_position_resumes_on_another_dp_size(before, after):
    """Positions saved by N ranks (with W workers) resume on M ranks: the next global batches equal an
    uninterrupted run's."""
    (n, wn), (m, wm) = before, after
    reference = _global([_steps(_loader(r, 1, 0), 5) for r in range(1)], 1)
    loaders = [_loader(r, n, wn) for r in range(n)]
    for loader in loaders:
        _steps(loader, 3)
    positions = [loader.position() for loader in loaders]
    assert {p["step"] for p in positions} == {3}
    rows = {j: s for p in positions for j, s in p["rows"].items()}
    assert sorted(rows) == list(range(GLOBAL_BATCH))
    resumed = []
    for r in range(m):
        loader = _loader(r, m, wm)
        loader.seek(3, rows)
        resumed.append(_steps(loader, 2))
    for got, want in zip(_global(resumed, m), reference[3:], strict=True):
        assert torch.equal(got, want)


def test_position_of_a_fresh_and_a_seeked_loader():
    loader = _loader(0, 2, 0)
    assert loader.position() == {"step": 0, "rows": {0: [0, 0, 0], 2: [0, 0, 0], 4: [0, 0, 0], 6: [0, 0, 0]}}
    loader.seek(7, {j: [1, 2, 3] for j in range(GLOBAL_BATCH)})
    assert loader.position()["step"] == 7


def test_metadata_reader_refuses_code(tmp_path):
    sd = {"w": torch.ones(2, 3), "group": [{"lr": 0.1, "params": ["a.b"], "betas": (0.9, 0.95)}]}
    dcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    md = read_metadata(tmp_path)
    assert tuple(md.state_dict_metadata["w"].size) == (2, 3)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        read_metadata(tmp_path)


def test_complete_steps_ignores_temporaries_and_partial_folders(tmp_path):
    for name in ("step-5", "step-10", "step-20.tmp-0123abcd", "step-7", "notes"):
        (tmp_path / name).mkdir()
    for name in ("step-5", "step-10"):
        (tmp_path / name / ".metadata").write_bytes(b"")
    assert complete_steps(tmp_path) == [5, 10]
    assert list(step_folders(tmp_path)) == [5, 7, 10]
    assert complete_steps(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--checkpoint.interval", "0", "checkpoint.interval"),
        ("--checkpoint.keep_latest_k", "-1", "keep_latest_k"),
        ("--checkpoint.load_step", "-2", "load_step"),
        ("--checkpoint.folder", "/abs", "relative"),
    ],
)
def test_config_errors(flag, value, match):
    with pytest.raises(ConfigError, match=match):
        validate_checkpoint_config(parse_args([flag, value]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory exists with CUDA")
def test_pinned_memory_needs_cuda():
    with pytest.raises(ConfigError, match="needs CUDA"):
        validate_checkpoint_config(parse_args(["--checkpoint.async_mode", "async_with_pinned_mem"]))
