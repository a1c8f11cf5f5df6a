import logging
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_dmuon.components.metrics import (
    WANDB_RUN_ID_FILE,
    MetricsLogger,
    device_memory_stats,
    get_peak_flops,
    max_and_mean_over_ranks,
    peak_flops_for_name,
    throughput_metrics,
    wandb_run_id,
)
from titan_dmuon.config import ConfigError, Metrics


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_tensorboard_and_console(tmp_path, caplog):
    clock = FakeClock()
    m = MetricsLogger(Metrics(log_freq=1), str(tmp_path), rank=0, total_steps=20, clock=clock)
    rows = {
        1: {
            "loss/train": 3.5,
            "grad_norm": 1.25,
            "lr": 0.01,
            "throughput/tokens_per_sec": 12345.0,
            "throughput/tokens_per_sec_global": 98760.0,
            "throughput/tflops": 0.5,
            "memory/rss_gib": 1.5,
            "dmuon/bytes_broadcast": 4096.0,
            "dmuon/ns_time_s": 0.125,
        },
        2: {
            "loss/train": 3.0,
            "grad_norm": 0.75,
            "lr": 0.02,
            "throughput/tokens_per_sec": 23456.0,
            "mfu": 35.2,
            "memory/max_reserved_gib": 2.0,
            "memory/max_reserved_pct": 12.5,
            "dmuon/bytes_broadcast": 8192.0,
            "dmuon/ns_time_s": 0.25,
        },
    }
    with caplog.at_level(logging.INFO, logger="titan_dmuon.components.metrics"):
        m.log(1, rows[1])
        clock.t += 30.0  # 30 s per step -> 18 steps left -> 9 minutes
        m.log(2, rows[2])
    m.close()

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert len(lines) == 2
    assert "loss: 3.5000" in lines[0] and "grad_norm: 1.2500" in lines[0] and "lr: 1.00e-02" in lines[0]
    assert "tps/rank: 12,345  tokens/s: 98,760" in lines[0] and "tflops: 0.500" in lines[0]
    assert "rss: 1.50GiB" in lines[0] and "tps/rank: 23,456" in lines[1] and "tokens/s" not in lines[1]
    assert "eta" not in lines[0]
    assert "step:    2" in lines[1] and "loss: 3.0000" in lines[1] and "mfu: 35.20%" in lines[1]
    assert "memory: 2.00GiB (12.5%)" in lines[1] and "eta: 0:09:00" in lines[1]

    tb_dir = tmp_path / "tb"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb_dir))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(rows[1]) | set(rows[2])
    for tag in ["loss/train", "grad_norm", "lr", "dmuon/bytes_broadcast", "dmuon/ns_time_s"]:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([rows[1][tag], rows[2][tag]], rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("mfu")] == [(2, pytest.approx(35.2, rel=1e-6))]


def test_non_zero_rank_and_disabled_tensorboard_write_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="titan_dmuon.components.metrics"):
        m = MetricsLogger(Metrics(), str(tmp_path / "r1"), rank=1, total_steps=5)
        m.log(1, {"loss/train": 1.0})
        m.close()
        m = MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path / "r0"), rank=0)
        m.log(1, {"loss/train": 2.0})
        m.close()
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r0").exists()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert lines == ["step:    1  loss: 2.0000"]


def test_flops_helpers():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA H20") == 148e12
    assert peak_flops_for_name("NVIDIA B200") == 2.25e15
    assert peak_flops_for_name("Some GPU") is None
    assert get_peak_flops("cpu") is None
    tm = throughput_metrics(tokens=2048, seconds=0.5, flops_per_token=10**9, peak_flops=989e12, ranks=8)
    assert tm["throughput/tokens_per_sec"] == 4096.0  # one rank's (device's)
    assert tm["throughput/tokens_per_sec_global"] == 8 * 4096.0  # all ranks' together
    assert tm["throughput/tflops"] == pytest.approx(4.096)
    assert tm["mfu"] == pytest.approx(100 * 4.096e12 / 989e12)
    assert "mfu" not in throughput_metrics(2048, 0.5, 10**9, None)


def test_memory_stats_cpu():  # the "cpu" device takes the RSS path on every host
    before = device_memory_stats("cpu")
    assert 0 < before["memory/rss_gib"] < 1024 and 0 < before["memory/max_rss_gib"] < 1024
    big = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = device_memory_stats("cpu")
    assert after["memory/rss_gib"] >= before["memory/rss_gib"] + 0.05
    del big


def test_memory_stats_cuda_device():
    """A "cuda" device: the allocator's peaks where CUDA is, else the process RSS (never an error)."""
    stats = device_memory_stats("cuda")
    if torch.cuda.is_available():
        assert set(stats) == {"memory/max_reserved_gib", "memory/max_allocated_gib", "memory/max_reserved_pct"}
        assert 0 <= stats["memory/max_allocated_gib"] <= stats["memory/max_reserved_gib"]
        assert 0 <= stats["memory/max_reserved_pct"] <= 100
    else:
        assert set(stats) == {"memory/rss_gib", "memory/max_rss_gib"}


def test_console_line_names_both_lrs_progress_and_total(tmp_path, caplog):
    m = MetricsLogger(Metrics(), str(tmp_path), rank=0, total_steps=30, clock=FakeClock())
    scalars = {
        "loss/train": 2.5,
        "lr/muon": 0.01,
        "lr/adamw": 3e-3,
        "progress/tokens_seen": 40960.0,
        "progress/elapsed_s": 83.4,
    }
    with caplog.at_level(logging.INFO, logger="titan_dmuon.components.metrics"):
        m.log(5, scalars)
    m.log_text("config", "    [job]\n    dump_folder = 'x'\n")
    m.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert line.startswith("step:    5/30  loss: 2.5000")
    assert "lr_muon: 1.00e-02  lr_adamw: 3.00e-03" in line
    assert "tokens: 40,960" in line and "elapsed: 0:01:23" in line
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "config/text_summary" in acc.Tags()["tensors"]
    assert {"lr/muon", "lr/adamw", "progress/tokens_seen"} <= set(acc.Tags()["scalars"])


def _scalar_events(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) TensorBoard shows per tag, in order (duplicates kept: a dict would hide them)."""
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_resumed_logger_shows_each_step_once_with_the_last_runs_value(tmp_path):
    """A run logged steps 1-4 and was killed after saving step 2; the rerun resumes there and logs steps 3-5 into
    the same folder (purge_step = 3): TensorBoard shows steps 1-5 once each, 3-5 with the rerun's values."""
    first = MetricsLogger(Metrics(), str(tmp_path), rank=0, purge_step=1)
    for step in range(1, 5):
        first.log(step, {"loss/train": float(step), "progress/elapsed_s": 10.0 * step})
    first.close()
    rerun = MetricsLogger(Metrics(), str(tmp_path), rank=0, purge_step=3)
    for step in range(3, 6):
        rerun.log(step, {"loss/train": 100.0 + step, "progress/elapsed_s": 20.0 + 11.0 * (step - 2)})
    rerun.close()
    events = _scalar_events(tmp_path / "tb")
    assert events["loss/train"] == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0)]
    assert [s for s, _ in events["progress/elapsed_s"]] == [1, 2, 3, 4, 5]


@pytest.mark.slow  # a fresh interpreter importing torch and the trainer: seconds
def test_importing_the_metrics_module_and_the_trainer_imports_no_wandb():
    code = "import sys, titan_dmuon.components.metrics, titan_dmuon.trainer; assert 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_logger_without_wandb_never_imports_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it would fail
    m = MetricsLogger(Metrics(), str(tmp_path), rank=0, purge_step=1)
    m.log(1, {"loss/train": 1.0})
    m.log_text("config", "    [job]\n")
    m.close()
    assert not (tmp_path / WANDB_RUN_ID_FILE).exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_enabling_wandb_without_the_package_is_a_config_error_naming_the_fix(tmp_path, monkeypatch, rank):
    """Every rank checks (so that all stop alike), before writing anything."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb needs the wandb package") as e:
        MetricsLogger(Metrics(enable_wandb=True), str(tmp_path / "dump"), rank=rank, purge_step=1)
    assert "pip install 'titan_dmuon[wandb]'" in str(e.value) and "pip install wandb" in str(e.value)
    assert not (tmp_path / "dump").exists()


def test_wandb_run_id_goes_on_only_for_a_resumed_run(tmp_path, monkeypatch):
    """A run from scratch saves a new id in the dump folder; a resumed run reuses it (a new one if there is none);
    $WANDB_RUN_ID wins."""
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    dump = str(tmp_path / "dump")
    first = wandb_run_id(dump, resumed=False)
    assert (tmp_path / "dump" / WANDB_RUN_ID_FILE).read_text() == first + "\n"
    assert len(first) == 8 and first.isalnum()
    assert wandb_run_id(dump, resumed=True) == first
    assert wandb_run_id(dump, resumed=True) == first
    second = wandb_run_id(dump, resumed=False)  # trained from scratch again: a new W&B run
    assert second != first and wandb_run_id(dump, resumed=True) == second
    other = str(tmp_path / "other")
    assert wandb_run_id(other, resumed=True) not in (first, second)  # resumed, but no run logged to W&B there
    monkeypatch.setenv("WANDB_RUN_ID", "chosen")
    assert wandb_run_id(dump, resumed=True) == wandb_run_id(dump, resumed=False) == "chosen"
    assert (tmp_path / "dump" / WANDB_RUN_ID_FILE).read_text() == second + "\n"


def test_over_ranks_without_a_process_group():
    maxes, means = max_and_mean_over_ranks({"a": 2.0, "c": 1.0}, ["a", "b"], "cpu")
    assert maxes == means == {"a": 2.0}  # "b" is nowhere, "c" not asked for


def _over_two_ranks(rank: int, world: int):
    import torch.distributed as dist

    values = {"ns_time_s": 1.0 + rank, "ns_calls": 3.0 * rank}
    if rank == 1:
        values["publish_wait_p90_us"] = 50.0  # on rank 1 only
    calls = []
    real = dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or real(*a, **k)
    from tests._dist import rank_device

    out = max_and_mean_over_ranks(values, ["ns_calls", "ns_time_s", "publish_wait_p90_us", "absent"], rank_device())
    return out, len(calls)


@pytest.mark.slow
def test_over_ranks_is_one_all_gather_for_max_and_mean():
    from tests._dist import run_distributed

    results = run_distributed(_over_two_ranks, 2)
    assert results[0] == results[1]  # every rank gets the figures
    (maxes, means), calls = results[0]
    assert calls == 1
    assert maxes == {"ns_calls": 3.0, "ns_time_s": 2.0, "publish_wait_p90_us": 50.0}
    assert means == {"ns_calls": 1.5, "ns_time_s": 1.5, "publish_wait_p90_us": 50.0}  # over the ranks that have it
