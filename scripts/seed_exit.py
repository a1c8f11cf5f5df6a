"""A DMuon script as the design examples end one: over gloo, finishing with dist.destroy_process_group() and
nothing else. `torchrun --nproc_per_node 2 scripts/seed_exit.py ddp` (or fsdp2); scripts/exit_stress.sh runs it N
times under CPU load and counts the exit codes (a SIGABRT at teardown would show as a non-zero one)."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_dmuon import dmuon
from titan_dmuon.models.tiny_mlp import TinyMLP, is_muon_target


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(42)
    model = TinyMLP()
    if path == "ddp":
        dmuon.dedicate_params_ddp(model, mesh, predicate=is_muon_target)
        dmuon.replicate(model, mesh)
    else:
        dmuon.dedicate_params(model, mesh, predicate=is_muon_target)
        for block in dmuon.fsdp_units(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    torch.manual_seed(rank)
    x = torch.randn(16, 256)
    for _ in range(5):
        optimizer.zero_grad()
        model(x).backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
