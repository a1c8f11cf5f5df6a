"""Weights & Biases logging (metrics.enable_wandb), offline: no network, every file under the test's tmp_path.

An offline run keeps its records in `<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb` (what `wandb sync`
uploads): W&B's record log, read back here with a reader of our own (`wandb_records`) and W&B's protobuf
definitions, independently of the code under test. W&B starts a service process (wandb-core) per process that
starts a run; `finish` ends the run, `wandb.teardown()` the service (it also exits with its parent process).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

from tests.train_runs import read_scalars, run_train, tail, tiny_train_argv

pytest.importorskip("wandb")

_BLOCK = 32 * 1024  # the log's block size: a record never starts in a block's last 6 bytes
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every record of a `.wandb` file: a 7-byte file header (":W&B", 2 bytes of magic, a version byte), then
    chunks each behind a 7-byte header (CRC-32C: 4 bytes, length: 2 bytes little-endian, type: 1 byte) that do
    not cross 32 KiB blocks; a record is one FULL chunk or FIRST, MIDDLE..., LAST; a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log: {data[:7]!r}"
    records, pos, parts = [], 7, []
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # the block's zero-filled tail
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zero padding to the end of the block
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        assert kind in (_FULL, _FIRST, _MIDDLE, _LAST), f"chunk type {kind} at {pos}"
        if kind in (_FULL, _FIRST):
            parts = []
        parts.append(chunk)
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
    return records


def offline_runs(dump: Path) -> list[Path]:
    """The `.wandb` files of the offline runs under `<dump>/wandb`, oldest first."""
    return sorted((dump / "wandb").glob("offline-run-*/run-*.wandb"))


def history(records) -> dict[int, dict[str, object]]:
    """step -> {key: value} of the history rows (W&B's own keys, "_step", "_runtime"..., left out)."""
    rows: dict[int, dict[str, object]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = rows.setdefault(r.history.step.num, {})
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def run_record(records):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run


def run_config(records) -> dict[str, object]:
    """The run's config, {key: value}: the run record's, then any later config records'."""
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = r.run.config.update if kind == "run" else r.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return config


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """Offline W&B, silent, whose own folders (settings, cache, staging) are under tmp_path; no W&B identity or
    run variables from the environment."""
    for name in ("WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_DIR", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    return tmp_path


@pytest.mark.timeout(120)
def test_logger_writes_each_step_once_and_finishes(wandb_offline):
    """MetricsLogger in this process: every scalar at its step, the config as a nested dict, no text entry; close
    finishes the run (its exit record is written)."""
    import wandb

    from titan_dmuon.components.metrics import WANDB_RUN_ID_FILE, MetricsLogger
    from titan_dmuon.config import JobConfig, Metrics

    dump = wandb_offline / "dump"
    cfg = Metrics(enable_tensorboard=False, enable_wandb=True, wandb_project="unit", wandb_run_name="logger")
    rows = {s: {"loss/train": 4.0 / s, "lr/muon": 0.01 * s, "progress/tokens_seen": 256.0 * s} for s in (1, 2, 3)}
    try:
        job = dataclasses.replace(JobConfig(), metrics=cfg)
        m = MetricsLogger(cfg, str(dump), rank=0, total_steps=3, purge_step=1, job_config=job)
        m.log_text("config", "    [job]\n")
        for step, row in rows.items():
            m.log(step, row)
        m.close()
        assert m.wandb_run is None
    finally:
        wandb.teardown()  # the service process
    (path,) = offline_runs(dump)
    run_id = (dump / WANDB_RUN_ID_FILE).read_text().strip()
    assert path.name == f"run-{run_id}.wandb"
    records = wandb_records(path)
    logged = history(records)
    assert sorted(logged) == [1, 2, 3]
    for step, row in rows.items():
        assert logged[step] == pytest.approx(row, rel=1e-12)
    run = run_record(records)
    assert (run.run_id, run.project, run.display_name) == (run_id, "unit", "logger")
    config = run_config(records)
    assert config["metrics"]["enable_wandb"] is True
    assert config["training"]["steps"] == JobConfig().training.steps
    assert any(r.WhichOneof("record_type") == "exit" for r in records)


def test_a_wandb_that_refuses_to_start_is_a_config_error(wandb_offline, monkeypatch):
    """wandb.init raising (online with no login, say) is a ConfigError that says how to log in or go offline; the
    TensorBoard writer opened before it is closed."""
    import wandb

    from titan_dmuon.components.metrics import MetricsLogger
    from titan_dmuon.config import ConfigError, Metrics

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    closed, real_close = [], MetricsLogger.close

    def close(self):
        closed.append(self.writer)
        real_close(self)

    monkeypatch.setattr(MetricsLogger, "close", close)
    with pytest.raises(ConfigError, match=r"W&B could not start run .*api_key not configured.*WANDB_MODE=offline"):
        MetricsLogger(Metrics(enable_wandb=True), str(wandb_offline / "dump"), rank=0, purge_step=1)
    assert len(closed) == 1 and closed[0] is not None  # the writer was open, and closed


@pytest.mark.slow
def test_train_run_logs_the_tensorboard_losses_and_a_resumed_run_goes_on_in_the_same_run(wandb_offline):
    """train.py, 1 process, 4 steps, a checkpoint every 2: the offline run holds every step's scalars, equal to the
    TensorBoard events and the console's loss; its config is the resolved one (the seed). Rerun to 6 steps, it
    resumes at step 4 and logs steps 5 and 6 under the same W&B run id."""
    dump = wandb_offline / "dump"
    common = ["--metrics.log_freq", "1", "--metrics.enable_wandb", "true", "--metrics.wandb_run_name", "tiny"]
    common += ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    proc = run_train(1, tiny_train_argv(dump, "--training.steps", "4", *common, tensorboard=True), timeout=240)
    assert proc.returncode == 0, tail(proc)
    (first,) = offline_runs(dump)
    records = wandb_records(first)
    logged = history(records)
    tb = read_scalars(dump / "tb")
    assert sorted(logged) == [1, 2, 3, 4]
    for step, row in logged.items():
        assert set(row) == {tag for tag, values in tb.items() if step in values}
        for tag, value in row.items():
            assert value == pytest.approx(tb[tag][step], rel=1e-6, abs=1e-12), (step, tag)
    printed = [line.split("loss: ")[1].split()[0] for line in proc.stderr.splitlines() if " step: " in line]
    assert printed == [f"{logged[s]['loss/train']:.4f}" for s in (1, 2, 3, 4)]
    run = run_record(records)
    assert (run.project, run.display_name) == ("titan_dmuon", "tiny")
    config = run_config(records)
    assert config["training"]["seed"] == 7 and config["training"]["steps"] == 4
    assert config["job"]["dump_folder"] == str(dump)

    proc = run_train(1, tiny_train_argv(dump, "--training.steps", "6", *common, tensorboard=True), timeout=240)
    assert proc.returncode == 0, tail(proc)
    assert "Resumed at step 4" in proc.stderr, tail(proc)
    old, resumed = offline_runs(dump)
    assert old == first and resumed.name == first.name  # run-<the same id>.wandb
    logged = history(wandb_records(resumed))
    tb = read_scalars(dump / "tb")
    assert sorted(logged) == [5, 6]
    assert [logged[s]["loss/train"] for s in (5, 6)] == pytest.approx([tb["loss/train"][s] for s in (5, 6)], rel=1e-6)


@pytest.mark.slow
def test_a_wandb_that_cannot_be_imported_is_a_config_error(wandb_offline, monkeypatch):
    """A `wandb` that is found but fails to import (here a stub package on PYTHONPATH): exit 2, one message naming
    the fix, no traceback."""
    stub = wandb_offline / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("a broken wandb")\n')
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    dump = wandb_offline / "dump"
    proc = run_train(1, tiny_train_argv(dump, "--training.steps", "2", "--metrics.enable_wandb", "true"), timeout=120)
    assert proc.returncode == 2, tail(proc)
    assert "pip install 'titan_dmuon[wandb]'" in proc.stderr, tail(proc)
    assert "Traceback" not in proc.stderr, tail(proc)
    assert not (dump / "wandb").exists()
