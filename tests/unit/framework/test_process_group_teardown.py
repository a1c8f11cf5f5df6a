"""destroy_process_groups (titan_dmuon/parallel/runtime.py) frees every group while the interpreter is alive.

A gloo group still referenced after `dist.destroy_process_group()` (by a DeviceMesh, FSDP2's mesh info, DMuon's
state) keeps its worker threads into the interpreter's teardown, where a worker releasing a finished collective's
tensors aborts the process ("terminate called without an active exception"). The invariant checked here, in a
fresh process: after destroy_process_groups no gloo thread is left, although such objects still exist.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.train_runs import REPO

_SCRIPT = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_dmuon.parallel.runtime import destroy_process_groups


    def gloo_threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # a thread that just ended
                pass
        return sorted(n for n in names if "gloo" in n)


    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()


    class Holder:  # as DMuon's state holds its shard group
        def __init__(self):
            self.group = dist.new_group(backend="gloo")


    holder = Holder()
    rows = [None]
    dist.all_gather_object(rows, {"rank": 0})  # the kind of collective a run ends with (checkpoint memory rows)
    assert gloo_threads(), "gloo runs no threads here: the check below would prove nothing"
    dropped = destroy_process_groups()
    left = gloo_threads()
    assert not left, f"gloo threads still running after destroy_process_groups: {left}"
    assert dropped >= 2 and holder.group is None, (dropped, holder.group)
    print("OK", dropped)
    """
)


@pytest.mark.slow
def test_destroy_process_groups_leaves_no_gloo_thread() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120, env=None
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
