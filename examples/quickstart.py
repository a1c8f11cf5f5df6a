"""Seed 003's quick start on any machine: DMuon + FSDP2 on a TinyMLP (gloo on CPU, NCCL on GPUs).

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_dmuon import dmuon


class Block(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.down_proj(self.gate_proj(h) * self.up_proj(h))


class TinyMLP(nn.Module):
    def __init__(self, d: int = 256, ff: int = 1024, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, ff) for _ in range(n_layers)])
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


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
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
