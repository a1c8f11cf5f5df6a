"""scripts/gpu_check.sh and what it runs: the list of private torch APIs covers every private use in the code (a scan
of titan_dmuon/) and each listed guard is in its file; each listed API is on this torch; a failing section (a planted
one, a failing command inside a pipe, a section out of the time budget) makes the script exit 1; dmuon/comm.py's
guards of the private APIs it calls and its debug delay of the side streams."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed import distributed_c10d as c10d

from tests._scripts import load_script
from titan_dmuon.dmuon import comm

REPO = Path(__file__).resolve().parents[3]
api = load_script("gpu_check_api")


def test_every_private_torch_use_is_listed() -> None:
    uses = api.scan()
    assert len({u.name for u in uses}) >= 30  # the scan sees the code
    left = api.uncovered(uses)
    assert not left, "private torch uses missing from scripts/gpu_check_api.py:\n" + "\n".join(
        f"  {u.file}:{u.line} {u.chain}" for u in left
    )


def test_each_guarded_entry_has_its_guard_in_its_files() -> None:
    assert api.missing_guards() == []
    # and every listed file exists and still uses the name (no stale entries)
    for entry in api.PRIVATE_APIS:
        for f in entry.used_in:
            text = (REPO / "titan_dmuon" / f).read_text()
            assert any(n in text for n in entry.private_names()), f"{entry.path}: not used in {f} any more"


def test_the_scan_finds_each_kind_of_private_use(tmp_path) -> None:
    pkg = tmp_path / "titan_dmuon"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d
            from torch.x._private_mod import thing
            from . import sibling

            class Mine:
                _own_class_attr = 1

                def __init__(self):
                    self._own = 1

            def f(group, obj):
                torch._C._brand_new()
                c10d._also_new()
                group._foreign_attr
                getattr(obj, "_by_string", None)
                sibling._project_private()
                Mine()._own_class_attr
                return Mine()._own
            """
        )
    )
    for name in ("dmuon.py", "train.py"):
        (tmp_path / name).write_text("")
    found = {u.name for u in api.scan(tmp_path)}
    assert {"_C", "_brand_new", "_also_new", "_private_mod", "_foreign_attr", "_by_string"} <= found
    assert not found & {"_own", "_own_class_attr", "_project_private"}
    assert {u.name for u in api.uncovered(api.scan(tmp_path))} == found  # none of these is listed


def test_each_listed_api_is_on_this_torch() -> None:
    lines: list[str] = []
    assert api.check(out=lines.append), "\n".join(lines)
    assert not any("absent" in line for line in lines), "\n".join(lines)  # 2.13 has even the guarded ones
    assert not c10d.is_initialized()  # the DTensor probes tore their fake world down


def _gpu_check(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    full.update({"GPU_CHECK_ALLOW_CPU": "1", "PYTHON": sys.executable, "GPU_CHECK_WHEELS": "/nonexistent"}, **env)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=full, capture_output=True, text=True, timeout=timeout
    )


def test_a_failing_command_inside_the_train_pipe_fails_the_script() -> None:
    """The planted failure of the train section is a config error of train.py inside `train.py | tee`: the
    section must read train.py's status, not tee's (it read tee's before)."""
    proc = _gpu_check({"GPU_CHECK_ONLY": "train", "GPU_CHECK_PLANT_FAIL": "train"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "train.py exited 2" in out and "==== [train] FAIL (exit 2" in out, out
    assert "FAILED: train" in out


@pytest.mark.slow
def test_a_planted_failure_of_a_passing_section_fails_the_script() -> None:
    ok = _gpu_check({"GPU_CHECK_ONLY": "env"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "every section OK" in ok.stdout
    planted = _gpu_check({"GPU_CHECK_ONLY": "env", "GPU_CHECK_PLANT_FAIL": "env"})
    assert planted.returncode == 1, planted.stdout + planted.stderr
    assert "==== [env] FAIL" in planted.stdout and "FAILED: env" in planted.stdout


def test_a_section_out_of_the_time_budget_fails_the_script() -> None:
    proc = _gpu_check({"GPU_CHECK_ONLY": "compat,moe", "GPU_CHECK_BUDGET_S": "0"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: compat(out of budget) moe(out of budget)" in proc.stdout


def test_fetch_wheels_refuses_an_unpinned_torch() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_wheels.sh"), "--torch-spec", "torch>=2.13", "--dest", "/nonexistent"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "must pin one version" in proc.stderr


# ---- dmuon/comm.py: the guards and the debug delay ------------------------------------------------------------


def test_torchcomms_guard(monkeypatch) -> None:
    monkeypatch.setattr(c10d, "_use_torchcomms_enabled", lambda: True, raising=False)
    assert comm._torchcomms_enabled() is True
    monkeypatch.delattr(c10d, "_use_torchcomms_enabled")  # a torch from before TorchComms
    assert comm._torchcomms_enabled() is False
    assert comm._split_from_parent(False) is False


def test_slow_streams_setting(monkeypatch) -> None:
    monkeypatch.delenv(comm.SLOW_STREAMS_ENV, raising=False)
    assert comm.slow_streams_cycles() == 0
    monkeypatch.setenv(comm.SLOW_STREAMS_ENV, "1000")
    assert comm.slow_streams_cycles() == 1000
    for bad in ("-1", "fast"):
        monkeypatch.setenv(comm.SLOW_STREAMS_ENV, bad)
        with pytest.raises(ValueError, match=comm.SLOW_STREAMS_ENV):
            comm.slow_streams_cycles()


class _FakeStream:
    def __init__(self, log):
        self.log = log

    def wait_stream(self, other):
        self.log.append("wait_stream")


def test_a_slowed_side_stream_sleeps_on_it_each_time_it_is_entered(monkeypatch) -> None:
    """CudaStreams.use with the debug delay: the stream first waits for compute, then (on it) the sleep, then the
    caller's ops; without the delay no sleep. (CUDA streams stood in for by fakes: this runs on CPU.)"""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")

    @contextlib.contextmanager
    def on(stream):
        log.append("enter")
        yield
        log.append("exit")

    monkeypatch.setattr(torch.cuda, "stream", on)
    for cycles, sleeps in ((0, []), (123, ["sleep 123"])):
        monkeypatch.setenv(comm.SLOW_STREAMS_ENV, str(cycles))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: _FakeStream(log))
        monkeypatch.setattr(torch.cuda, "_sleep", lambda c: log.append(f"sleep {c}"), raising=False)
        streams = comm.CudaStreams(torch.device("cuda", 0))
        log.clear()
        with streams.use("reduce"):
            log.append("op")
        assert log == ["wait_stream", "enter", *sleeps, "op", "exit"]
