"""titan_dmuon/components/checkpoint/ and the data loader's global position, in one process (the train.py runs are in
tests/integration/test_checkpoint.py)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_dmuon.components.checkpoint import check_async_mode, complete_steps, read_metadata, step_folders
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
    with pytest.raises(ConfigError, match=match):  # the [checkpoint] section's validate(), from validate_config
        parse_args([flag, value])


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory exists with CUDA")
def test_pinned_memory_needs_cuda():
    with pytest.raises(ConfigError, match="needs CUDA"):
        check_async_mode(parse_args(["--checkpoint.async_mode", "async_with_pinned_mem"]))


# ---------------------------------------------------- the manager on real gloo ranks, with a stand-in state
class _Component:
    """The optimizer component's DCP face (the checkpoint contract) over one weight and one momentum tensor,
    the same on every rank (DCP de-duplicates the keys)."""

    def __init__(self, value: float):
        self.w, self.momentum = torch.full((4,), value), torch.zeros(4)

    def model_state_dict(self):
        return {"w": self.w}  # aliases live storage: dcp.load writes into it

    def load_model_state_dict(self, sd):
        pass

    def state_dict(self):
        return {"state": {"w": {"momentum": self.momentum}}}

    def load_state_dict(self, sd):
        pass

    def checkpoint_state_dict(self):  # no pipeline: the optimizer's own dict
        return self.state_dict()

    def load_checkpoint_state_dict(self, sd):
        self.load_state_dict(sd)


class _Loader:
    """One row of the global batch per rank (row = rank), never advanced."""

    def __init__(self, rank: int):
        self.rows = [rank]

    def position(self):
        return {"step": 0, "rows": {j: [0, 0, 0] for j in self.rows}}


def _manager(rank: int, world: int, dump, *args: str, value: float = 1.0):
    import types

    from titan_dmuon.components.checkpoint import CheckpointManager

    cfg = parse_args(["--job.dump_folder", str(dump), "--checkpoint.enable", "true", *args])
    return CheckpointManager(
        cfg,
        optim=_Component(value),
        lr_scheduler=types.SimpleNamespace(last_epoch=0),
        dataloader=_Loader(rank),
        dp_rank=rank,
        dp_world_size=world,
        global_batch_size=world,
        device=torch.device("cpu"),
        seed=0,
    )


def _hide_from_this_rank(folder) -> None:
    """This process alone gets an empty tmpfs over `folder` (a private mount namespace): it no longer sees what
    the other ranks write there, as on a node without the shared filesystem."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    if libc.unshare(clone_newns) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "unshare/mount")
    if libc.mount(b"none", os.fsencode(folder), b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {folder}")


def _slow_save(rank: int, world: int, dump, async_mode: str):
    """A save in which rank 1 writes its files 3 s after rank 0 and rank 0 commits 3 s after rank 1, under a
    training timeout of 1 s (set after the manager made its async group, as the trainer does after step 1),
    then training steps (one collective each) while an async save is still being written and committed."""
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from titan_dmuon.components.checkpoint import CheckpointManager
    from titan_dmuon.parallel.runtime import set_collective_timeout

    manager = _manager(rank, world, dump, "--checkpoint.async_mode", async_mode, "--checkpoint.timeout_seconds", "60")
    set_collective_timeout(1.0)
    write_data, prune = FileSystemWriter.write_data, CheckpointManager._prune

    def slow_write(self, plan, planner):
        time.sleep(3.0)
        return write_data(self, plan, planner)

    def slow_prune(self):
        time.sleep(3.0)
        prune(self)

    if rank == 1:
        FileSystemWriter.write_data = slow_write
    else:
        CheckpointManager._prune = slow_prune
    manager.save(1, 10)
    for step in range(2, 18):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.5)
        manager.maybe_save(step, 10 * step)
    manager.close()
    set_collective_timeout(60.0)  # the harness's closing barrier
    return complete_steps(dump / "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_save_outlasting_the_training_timeout(tmp_path, async_mode):
    """A save's collectives wait up to checkpoint.timeout_seconds, not comm.train_timeout_seconds."""
    from tests._dist import run_distributed

    assert run_distributed(_slow_save, 2, tmp_path, async_mode, timeout=120) == [[1], [1]]


def _save_without_shared_folder(rank: int, world: int, dump):
    from titan_dmuon.components.checkpoint import CheckpointError

    manager = _manager(rank, world, dump)
    if rank == 1:
        _hide_from_this_rank(dump)
    try:
        manager.save(1, 10)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_checkpoint_folder_not_shared_is_an_error_on_every_rank(tmp_path):
    """Rank 1 does not see rank 0's dump folder: the first save fails on both ranks, naming the folder, and
    leaves nothing in it (no temporary, no "complete" checkpoint)."""
    from tests._dist import run_distributed

    dump = tmp_path / "dump"
    dump.mkdir()
    errors = run_distributed(_save_without_shared_folder, 2, dump, timeout=120)
    folder = dump / "checkpoint"
    for error in errors:
        assert error and "filesystem every rank sees" in error and str(folder) in error and "[1]" in error
    assert list(folder.iterdir()) == []


def _resume_without_shared_folder(rank: int, world: int, dump):
    import torch.distributed as dist

    from titan_dmuon.components.checkpoint import CheckpointError

    _manager(rank, world, dump).save(1, 10)  # both ranks see it
    dist.barrier()
    if rank == 1:
        _hide_from_this_rank(dump)
    try:
        _manager(rank, world, dump).load()
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_resume_from_a_folder_one_rank_does_not_see_is_an_error_on_every_rank(tmp_path):
    """The resume's check reads only (a finished run's rerun writes nothing), and still stops every rank, before DCP,
    when rank 1 does not see the checkpoint rank 0 resumes from."""
    from tests._dist import run_distributed

    errors = run_distributed(_resume_without_shared_folder, 2, tmp_path, timeout=120)
    assert errors[0] == errors[1] and "filesystem every rank sees" in errors[0], errors
    assert "rank(s) [1] do not see step-1, which rank 0 resumes from" in errors[0]


def _initial_load_not_shared(rank: int, world: int, dump, initial):
    from titan_dmuon.components.checkpoint import CheckpointError

    if rank == 1:
        _hide_from_this_rank(initial.parent)
    manager = _manager(rank, world, dump, "--checkpoint.initial_load_path", str(initial))
    try:
        manager.load()
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_initial_load_path_seen_by_one_rank_only_is_an_error_on_every_rank(tmp_path):
    """Rank 0 sees a DCP checkpoint at initial_load_path, rank 1 sees nothing there: an error on both, no hang."""
    from tests._dist import run_distributed

    initial = tmp_path / "elsewhere" / "step-3"
    dcp.save({"model": {"w": torch.full((4,), 3.0)}}, checkpoint_id=initial, no_dist=True)
    errors = run_distributed(_initial_load_not_shared, 2, tmp_path / "dump", initial, timeout=120)
    assert errors[0] == errors[1] and f"initial_load_path {initial} is not a folder on rank(s) [1]" in errors[0]


def _save_with_unwritable_folder(rank: int, world: int, dump):
    from pathlib import Path

    from titan_dmuon.components.checkpoint import CheckpointError

    manager = _manager(rank, world, dump)
    if rank == 0:

        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))

        Path.mkdir = refuse
    try:
        manager.save(1, 10)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_rank_0_unable_to_write_fails_every_rank(tmp_path):
    from tests._dist import run_distributed

    errors = run_distributed(_save_with_unwritable_folder, 2, tmp_path, timeout=120)
    assert errors[0] == errors[1] and "Permission denied" in errors[0]


def _initial_load_with_checkpoint_disabled(rank: int, world: int, dump, initial):
    saver = _manager(rank, world, dump, value=5.0)
    saver.save(5, 50)
    loader = _manager(rank, world, dump, "--checkpoint.enable", "false", "--checkpoint.initial_load_path", str(initial))
    return loader.load(), loader.optim.w


@pytest.mark.slow
def test_initial_load_path_with_checkpoints_disabled_ignores_the_folder(tmp_path):
    """checkpoint.enable = false: initial_load_path's weights, not the folder's newest checkpoint."""
    from tests._dist import run_distributed

    initial = tmp_path / "initial"
    dcp.save({"model": {"w": torch.full((4,), 3.0)}}, checkpoint_id=initial, no_dist=True)
    ((step_tokens, w),) = run_distributed(_initial_load_with_checkpoint_disabled, 1, tmp_path / "dump", initial)
    assert step_tokens == (0, 0)
    assert torch.equal(w, torch.full((4,), 3.0))


def _prune_around_model_only(rank: int, world: int, dump):
    manager = _manager(rank, world, dump, "--checkpoint.keep_latest_k", "1")
    folder, seen = dump / "checkpoint", []
    manager.save(2, 20)
    manager.save(4, 40, model_only=True)
    seen.append(complete_steps(folder))
    manager.save(6, 60)
    seen.append(complete_steps(folder))
    manager.save(8, 80, model_only=True)
    seen.append(complete_steps(folder))
    return seen


@pytest.mark.slow
def test_keep_latest_k_counts_full_checkpoints_only(tmp_path):
    """keep_latest_k = 1 with model-only saves in between: the newest full checkpoint always survives, and a
    model-only one neither counts nor is deleted."""
    from tests._dist import run_distributed

    (seen,) = run_distributed(_prune_around_model_only, 1, tmp_path)
    assert seen == [[2, 4], [4, 6], [4, 6, 8]]
    for step, full in ((4, False), (6, True), (8, False)):
        keys = read_metadata(tmp_path / "checkpoint" / f"step-{step}").state_dict_metadata
        assert any(k.startswith("optimizer.") for k in keys) == full


def _pinned_saves(rank: int, world: int, dump):
    from torch.distributed.checkpoint import staging

    made, closed = [], []

    class Stager(staging.DefaultStager):  # DefaultStager minus the pinned memory (no CUDA here)
        def __init__(self, options):
            assert options.use_pinned_memory
            super().__init__(staging.StagingOptions(False, False, False, False))
            made.append(self)

        def close(self):
            closed.append(self)
            super().close()

    staging.DefaultStager = Stager
    manager = _manager(rank, world, dump, "--checkpoint.async_mode", "async_with_pinned_mem")
    for step in (1, 2, 3):
        manager.save(step, step)
    manager.close()
    return len(made), closed == made, complete_steps(dump / "checkpoint")


@pytest.mark.slow
def test_pinned_memory_stager_is_made_once_and_closed(tmp_path):
    """async_with_pinned_mem: one stager (its pinned buffers) serves every save, closed by close()."""
    from tests._dist import run_distributed

    assert run_distributed(_pinned_saves, 1, tmp_path) == [(1, True, [1, 2, 3])]


def test_memory_rows_of_a_save_are_one_summary_line() -> None:
    """1,024 ranks' rows are one log line: [min, median, max] of each figure and the worst growth beyond the rank's
    own state share, naming the rank."""
    from titan_dmuon.components.checkpoint.memory import memory_summary

    rows = [
        {
            "what": "save",
            "step": 7,
            "rank": r,
            "rss_before_mib": 100.0 + r,
            "peak_before_mib": 100.0,
            "peak_after_mib": 110.0 + r + (40 if r == 5 else 0),
            "rss_after_mib": 105.0,
            "state_share_mib": 8.0,
        }
        for r in range(1024)
    ]
    out = memory_summary(rows)
    assert out["ranks"] == 1024 and (out["what"], out["step"]) == ("save", 7)
    assert out["rss_before_mib"] == [100.0, 612.0, 1123.0]
    assert out["peak_growth_mib"] == [10.0, 10.0, 50.0]
    assert out["growth_beyond_share_mib"] == {"max": 42.0, "rank": 5}


def test_memory_summary_reads_as_one_sentence() -> None:
    """The INFO line says the worst growth, the rank that grew past its state share and by how much, and the RSS
    span (the JSON record goes to DEBUG)."""
    from titan_dmuon.components.checkpoint.memory import memory_line

    summary = {
        "what": "save",
        "step": 10,
        "ranks": 4,
        "rss_before_mib": [600.0, 610.5, 640.25],
        "peak_after_mib": [700.0, 705.0, 760.0],
        "peak_growth_mib": [1.5, 2.0, 30.0],
        "state_share_mib": [10.0, 10.0, 12.5],
        "growth_beyond_share_mib": {"max": 17.5, "rank": 3},
    }
    assert memory_line(summary, gathered=True) == (
        "checkpoint save of step 10 (4 ranks): peak memory +30.0 MiB at most, rank 3 grew 17.5 MiB beyond its state "
        "share (10.0-12.5 MiB); RSS 600.0-640.2 MiB before"
    )
    one = {**summary, "what": "load", "ranks": 1, "rss_before_mib": [675.6] * 3, "peak_growth_mib": [0.0] * 3}
    one |= {"state_share_mib": [40.6] * 3, "growth_beyond_share_mib": {"max": -40.6, "rank": 0}}
    assert memory_line(one, gathered=True) == (
        "checkpoint load of step 10 (1 rank): peak memory +0.0 MiB at most, within each rank's state share "
        "(40.6 MiB); RSS 675.6 MiB before"
    )
    assert "(rank 0's figures)" in memory_line({**one, "what": "save (staged)"}, gathered=False)


def _resumed(rank: int, world: int, dump):
    """(load()'s (step, tokens_seen), elapsed_s) of a manager resuming from the folder's newest checkpoint."""
    manager = _manager(rank, world, dump)
    manager.dataloader.seek = lambda step, rows: None  # the stand-ins keep no position or schedule
    manager._load_lr_scheduler = lambda last_epoch: None
    return manager.load(), manager.elapsed_s


def _elapsed_saves(rank: int, world: int, dump):
    old = _manager(rank, world, dump)
    state_dict = old._state_dict

    def without_elapsed(*args):  # a checkpoint saved before train_state.elapsed_s was kept
        sd = state_dict(*args)
        del sd["train_state"]["elapsed_s"]
        return sd

    old._state_dict = without_elapsed
    old.save(5, 50, elapsed_s=99.0)
    seen = [_resumed(rank, world, dump)]
    _manager(rank, world, dump).save(7, 70, elapsed_s=1234.5)
    seen.append(_resumed(rank, world, dump))
    return seen


@pytest.mark.slow
def test_elapsed_time_is_kept_and_an_older_checkpoint_without_it_still_loads(tmp_path):
    """train_state.elapsed_s round-trips; a checkpoint without it resumes with elapsed time 0."""
    from tests._dist import run_distributed

    (seen,) = run_distributed(_elapsed_saves, 1, tmp_path)
    assert seen == [((5, 50), 0.0), ((7, 70), 1234.5)]
    assert "train_state.elapsed_s" not in read_metadata(tmp_path / "checkpoint" / "step-5").state_dict_metadata


# ------------------------------------------------ checksums.json (titan_dmuon/components/checkpoint/integrity.py)
def _checksummed_step(folder, block_bytes: int = 2000):
    """A DCP save of a few tensors and a non-tensor item through ChecksummingWriter (blocks of at most `block_bytes`,
    so that the larger items span several) and its manifest: what a commit leaves in a step folder."""
    from titan_dmuon.components.checkpoint.integrity import ChecksummingWriter, write_manifest

    gen = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(300, generator=gen), "group": [{"lr": 0.1}]}
    writer = ChecksummingWriter(folder, sync_files=True, block_bytes=block_bytes)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    (folder / "config.toml").write_text("[model]\nname = 'llama3'\n")
    write_manifest(folder, writer.digests, extra=["config.toml"])
    return writer.digests


def _items(folder) -> dict[str, tuple[str, int, int]]:
    """Each saved item's (file, offset, length), by key, from DCP's metadata."""
    return {k.fqn: (v.relative_path, v.offset, v.length) for k, v in read_metadata(folder).storage_data.items()}


def test_writer_records_each_item_as_written(tmp_path):
    """The CRC32s computed while DCP wrote equal those of the bytes on disk, for every file DCP wrote (its data file
    and .metadata; no file is read back at save time); the data file's blocks start and end where DCP's items do,
    so a rank that loads an item checks its bytes and no others."""
    import zlib

    from titan_dmuon.components.checkpoint.integrity import blocks_of, read_manifest

    digests = _checksummed_step(tmp_path)
    written = {p.name for p in tmp_path.iterdir()} - {"checksums.json", "config.toml"}
    assert set(digests) == written == {".metadata", "__0_0.distcp"}
    for name, digest in digests.items():
        data = (tmp_path / name).read_bytes()
        assert digest.size == len(data) and all(0 < length <= 2000 for length, _ in digest.blocks), name
        assert all(zlib.crc32(data[s : s + n]) == crc for s, n, crc in blocks_of(digest)), name
    starts = {s for s, _, _ in blocks_of(digests["__0_0.distcp"])} | {digests["__0_0.distcp"].size}
    items = _items(tmp_path)
    assert sorted(items) == ["a", "b", "group.0.lr"]
    for _, offset, length in items.values():
        assert offset in starts and offset + length in starts
    assert set(read_manifest(tmp_path).files) == written | {"config.toml"}


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("truncate", r"^__0_0\.distcp is 4500 bytes, \d+ expected \(truncated\)$"),
        ("delete", r"^__0_0\.distcp is missing$"),
        ("flip", r"^__0_0\.distcp: bytes (\d+)-(\d+) differ from their checksum \(changed since the save\)$"),
        ("flip_metadata", r"^\.metadata: bytes 0-\d+ differ from their checksum"),
        ("grow", r"^config\.toml is \d+ bytes, \d+ expected \(grown since the save\)$"),
        ("manifest", r"^checksums\.json is unreadable \(JSONDecodeError"),
        ("extra_file", None),
        ("no_manifest", None),
    ],
)
def test_verify_names_the_damage(tmp_path, damage, match):
    """A truncated, deleted or changed file (one flipped bit) is named with what is wrong; a file the manifest does
    not list is ignored (nothing loaded changes); a folder without checksums.json (saved before it was kept) has
    nothing to be checked against."""
    from titan_dmuon.components.checkpoint.integrity import read_manifest, verify

    _checksummed_step(tmp_path)
    assert verify(tmp_path) is None
    data = tmp_path / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:4500])
    elif damage == "delete":
        data.unlink()
    elif damage == "flip":
        _flip(data, 5432)
    elif damage == "flip_metadata":
        _flip(tmp_path / ".metadata", 10)
    elif damage == "grow":
        with open(tmp_path / "config.toml", "a") as f:
            f.write("# edited\n")
    elif damage == "manifest":
        (tmp_path / "checksums.json").write_text('{"version": 1, "files": ')
    elif damage == "extra_file":
        (tmp_path / "notes.txt").write_text("a user's note\n")
        (tmp_path / "__9_0.distcp").write_bytes(b"\0" * 10)
    else:
        (tmp_path / "checksums.json").unlink()
        assert read_manifest(tmp_path) is None
    problem = verify(tmp_path)
    if match is None:
        assert problem is None
    else:
        found = re.search(match, problem or "")
        assert found, problem
        if damage == "flip":  # the block that holds the changed byte
            assert int(found.group(1)) <= 5432 <= int(found.group(2)) < int(found.group(1)) + 2000


def test_only_the_blocks_a_rank_reads_are_checked():
    """check_blocks reads the blocks that hold the given byte ranges, and no other: a changed byte in one item is
    found by a rank that loads that item, with the item's own bytes named, and not by one that loads another item
    (what it loads is intact)."""
    import tempfile
    from pathlib import Path

    from titan_dmuon.components.checkpoint.integrity import FileDigest, blocks_of, check_blocks, read_manifest

    digest = FileDigest(35, [(10, 1), (20, 2), (5, 3)])
    assert blocks_of(digest, [(0, 10)]) == [(0, 10, 1)] and blocks_of(digest, [(12, 0)]) == []
    assert blocks_of(digest, [(9, 2), (30, 5)]) == [(0, 10, 1), (10, 20, 2), (30, 5, 3)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _checksummed_step(folder)
        items = _items(folder)
        (_, a_offset, a_length), (_, g_offset, g_length) = items["a"], items["group.0.lr"]
        assert g_length < 2000  # one block: the item itself
        _flip(folder / "__0_0.distcp", g_offset + g_length // 2)
        manifest = read_manifest(folder)
        assert check_blocks(folder, manifest, "__0_0.distcp", [(a_offset, a_length)]) is None
        want = f"__0_0.distcp: bytes {g_offset}-{g_offset + g_length - 1} differ from their checksum"
        assert check_blocks(folder, manifest, "__0_0.distcp", [(g_offset, g_length)]).startswith(want)
        assert check_blocks(folder, manifest, "__0_0.distcp").startswith(want)


def _saves_with_checksums(rank: int, world: int, dump, async_mode: str):
    """Two saves (synchronous, or committed by the async save's thread): each step folder's checksums.json lists
    every file of the folder, and verifies."""
    import torch.distributed as dist

    from titan_dmuon.components.checkpoint.integrity import read_manifest, verify

    manager = _manager(rank, world, dump, "--checkpoint.async_mode", async_mode)
    manager.save(1, 10)
    manager.save(2, 20)
    manager.close()
    dist.barrier()  # rank 0's commit (in the save's thread) is done
    out = {}
    for step in (1, 2):
        folder = dump / "checkpoint" / f"step-{step}"
        manifest = read_manifest(folder)
        out[step] = (sorted(manifest.files), sorted(p.name for p in folder.iterdir()), verify(folder))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_every_save_writes_checksums_of_every_rank_file(tmp_path, async_mode):
    from tests._dist import run_distributed

    out, _ = run_distributed(_saves_with_checksums, 2, tmp_path, async_mode)
    for step in (1, 2):
        listed, present, problem = out[step]
        assert listed == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.toml"]
        assert present == sorted([*listed, "checksums.json"]) and problem is None


def _resume_logs(rank: int, world: int, dump, *args: str):
    """(load()'s (step, tokens) or the CheckpointError's message, the weight w loaded, rank 0's checkpoint log)."""
    import logging

    from titan_dmuon.components.checkpoint import CheckpointError

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(f"{record.levelname} {record.getMessage()}")
    logger = logging.getLogger("titan_dmuon.components.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    import torch.distributed as dist

    manager = _manager(rank, world, dump, *args, value=0.0)
    manager.dataloader.seek = lambda step, rows: None  # the stand-ins keep no position or schedule
    manager._load_lr_scheduler = lambda last_epoch: None
    state_dict, calls = manager.optim.state_dict, []

    def state_dict_with_a_collective():  # as torch's get_optimizer_state_dict of a fresh optimizer (it steps it)
        if not calls:
            dist.all_reduce(torch.ones(1))
        calls.append(1)
        return state_dict()

    manager.optim.state_dict = state_dict_with_a_collective
    try:
        loaded = manager.load()
    except CheckpointError as e:
        loaded = str(e)
    finally:
        logger.removeHandler(handler)
    return loaded, manager.optim.w.clone(), records


def _damaged_resumes(rank: int, world: int, dump):
    """Steps 2 and 4 saved (w = 2.0, 4.0); then, in turn: step-4's rank-1 file truncated (the resume takes step 2); a
    bit flipped in rank 1's RNG state, which rank 1 alone reads (its own block: both ranks still take step 2);
    config.toml changed, which rank 0 alone checks (while rank 1 builds its template, whose first optimizer state
    dict runs a collective here, as torch's does for a fresh optimizer);
    load_step = 4 at a truncated step-4 (an error); step-4 without checksums.json (a checkpoint saved before them:
    loaded unchecked); initial_load_path at a damaged step (an error)."""
    import shutil

    import torch.distributed as dist

    for step in (2, 4):
        _manager(rank, world, dump, value=float(step)).save(step, 10 * step)
    folder = dump / "checkpoint"
    shutil.copytree(folder, dump / "pristine") if rank == 0 else None
    data = folder / "step-4" / "__1_0.distcp"

    def damage(fn) -> None:  # rank 0 changes the folder while rank 1 waits
        if rank == 0:
            shutil.rmtree(folder)
            shutil.copytree(dump / "pristine", folder)
            fn()
        dist.barrier()

    seen = {}
    damage(lambda: data.write_bytes(data.read_bytes()[:100]))
    seen["fallback"] = (*_resume_logs(rank, world, dump), sorted(p.name for p in folder.iterdir()))
    info = read_metadata(dump / "pristine" / "step-4").storage_data
    rng = next(v for k, v in info.items() if k.fqn == "rng.rank1.torch")  # rank 1's alone: in its file
    damage(lambda: _flip(folder / "step-4" / rng.relative_path, rng.offset + rng.length // 2))
    seen["rank1_only"] = _resume_logs(rank, world, dump)
    damage(lambda: (folder / "step-4" / "config.toml").write_text("# edited\n", encoding="utf-8") and None)
    seen["rank0_only"] = _resume_logs(rank, world, dump)  # rank 0 alone reads config.toml, before any template
    damage(lambda: data.write_bytes(data.read_bytes()[:100]))
    seen["load_step"] = _resume_logs(rank, world, dump, "--checkpoint.load_step", "4")
    damage(lambda: (folder / "step-4" / "checksums.json").unlink())
    seen["unchecked"] = _resume_logs(rank, world, dump)
    damage(lambda: _flip(data, 50))
    init = ["--checkpoint.folder", "other", "--checkpoint.initial_load_path", str(folder / "step-4")]
    seen["initial"] = _resume_logs(rank, world, dump, *init, "--checkpoint.initial_load_model_only", "false")
    return seen


@pytest.mark.slow
def test_a_damaged_step_is_skipped_or_named(tmp_path):
    """2 ranks. A resume skips the damaged newest step with one WARNING naming the file and sets it aside, loading
    the step before it (w = 2.0 on both ranks); load_step or initial_load_path at a damaged step is an error naming
    the damage (no other step instead); a step without checksums.json loads as before, with an INFO line."""
    from tests._dist import run_distributed

    ranks = run_distributed(_damaged_resumes, 2, tmp_path, timeout=120)
    for rank, seen in enumerate(ranks):
        loaded, w, log = seen["fallback"][:3]
        assert loaded == (2, 20) and torch.equal(w, torch.full((4,), 2.0)), (rank, loaded, w)
        warnings = [line for line in log if line.startswith("WARNING")]
        if rank == 0:
            assert len(warnings) == 1, warnings
            line = warnings[0]
            assert re.search(
                r"step-4 is damaged \(__1_0\.distcp is 100 bytes, \d+ expected \(truncated\), found by rank \d\); "
                r"resuming from step-2, the newest intact checkpoint; moved to step-4\.damaged-[0-9a-f]+",
                line,
            ), line
            names = seen["fallback"][3]
            assert names[0] == "step-2" and re.fullmatch(r"step-4\.damaged-[0-9a-f]+", names[1]), names
        else:
            assert warnings == [], warnings  # one line for the job
        loaded, w, log = seen["rank1_only"]  # the decision is every rank's
        assert loaded == (2, 20) and torch.equal(w, torch.full((4,), 2.0)), (rank, loaded, w)
        if rank == 0:
            (line,) = [line for line in log if line.startswith("WARNING")]
            assert re.search(r"step-4 is damaged \(__1_0\.distcp: bytes \d+-\d+ differ .*, found by rank 1\)", line)
        loaded, w, log = seen["rank0_only"]
        assert loaded == (2, 20) and torch.equal(w, torch.full((4,), 2.0)), (rank, loaded, w)
        if rank == 0:
            (line,) = [line for line in log if line.startswith("WARNING")]
            assert re.search(
                r"step-4 is damaged \(config\.toml is 9 bytes, \d+ expected \(truncated\), found by rank 0", line
            )
        loaded, w, log = seen["load_step"]
        assert re.fullmatch(
            r"checkpoint\.load_step = 4: \S+step-4 is damaged \(__1_0\.distcp is 100 bytes, \d+ expected "
            r"\(truncated\), found by rank \d\); set checkpoint\.load_step to another step, or move the folder away",
            loaded,
        ), loaded
        loaded, w, log = seen["unchecked"]
        assert loaded == (4, 40) and torch.equal(w, torch.full((4,), 4.0))
        if rank == 0:
            assert any(
                line.startswith("INFO")
                and "step-4 has no checksums.json (saved before checksums were kept): loading it unchecked" in line
                for line in log
            ), log
        loaded, w, log = seen["initial"]
        assert re.fullmatch(
            r"checkpoint\.initial_load_path \S+step-4 is damaged \(__1_0\.distcp: bytes 0-\d+ differ from their "
            r"checksum \(changed since the save\), found by rank \d\); point it at an intact checkpoint",
            loaded,
        ), loaded
