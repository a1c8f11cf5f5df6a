"""The quick start on any machine: DMuon + FSDP2 on a TinyMLP (gloo on CPU, NCCL on GPUs).

torchrun --standalone --nproc_per_node 2 examples/quickstart.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_dmuon import dmuon
from titan_dmuon.models.tiny_mlp import TinyMLP, is_muon_target


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(42)
    model = TinyMLP().to(device)
    dmuon.dedicate_params(model, mesh, predicate=is_muon_target)
    for block in dmuon.fsdp_units(model):  # the layers FSDP2 still has enough of (here: none, only LayerNorms)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: the head and the layers' LayerNorms
    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3)
    torch.manual_seed(rank)
    target = torch.randn(64, 256, device=device)
    for step in range(20):
        optimizer.zero_grad()
        loss = model(target)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss={loss.item():.4f}")
    if rank == 0:
        print(dmuon.get_ns_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
