"""Training-step time of DMuon vs naive FSDP2 + Muon vs FSDP2 + AdamW, on N real gloo ranks.

What it measures, in one run on the same N ranks (same seed-003 TinyMLP init, same per-rank data, same
number of steps for every configuration):

  dmuon             dmuon.dedicate_params (Z3 by default) on the "proj" matrices, fully_shard each layer and
                    the root, dmuon.Muon(lr=0.02, adamw_lr=1e-3, ns_coefficients="muon").
  dmuon_z2          the same with reshard_after_forward=False (only with --z2).
  naive_fsdp2_muon  every param fully_shard-ed by FSDP2; at step time each Muon-target grad shard is
                    all-gathered (DTensor.full_tensor()), every rank runs momentum + the same fp32 Newton-Schulz
                    on the full matrix and applies its own shard of the update; torch AdamW (foreach) on the rest.
  fsdp2_adamw       FSDP2 + torch.optim.AdamW (foreach) on every param.

All configurations are built up front and stepped round-robin (step s of each, then step s+1, ...), so
background load drifting during the run hits them alike. Step time = forward + backward + optimizer step
(zero_grad included), timed on every rank after a dist.barrier(), max over ranks per step, mean over the
timed steps (warmup steps excluded). The table also splits it into forward / backward / step (same
harness, max over ranks of each phase) and shows the 1-minute load average (other jobs on the machine).

DMuon Z3 resident/ideal: after the last step, per rank, bytes of `_owned_data` + Muon momentum buffers of the
dedicated params + any packed group buffer storage still allocated; max over ranks divided by
2 x 4 x P_M / N (fp32 params + momentum of all dedicated matrices, spread evenly).

Run (spawns its own gloo ranks on a free localhost port; one CPU thread per rank):

    python3 scripts/bench_step.py                      # N=4, d=256, ff=1024, 4 layers, batch 8, 10 steps
    python3 scripts/bench_step.py --nproc 2 --z2       # also DMuon-Z2
    python3 scripts/bench_step.py --nproc 4 --steps 10 --warmup 3 --d 256 --ff 1024 --layers 4 --batch 8
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Hyper-parameters shared by every configuration (dmuon.Muon's defaults, spelled out for the naive baseline).
MUON_LR, MOMENTUM, NS_STEPS, NS_COEFFS, NS_EPS = 0.02, 0.95, 5, "muon", 1e-7
ADAMW_LR, ADAMW_BETAS, ADAMW_EPS, ADAMW_WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


# ---- model and data (seed 003) -------------------------------------------------------------------------
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
    def __init__(self, d: int, ff: int, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, ff) for _ in range(n_layers)])
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def is_muon_target(name: str, p: torch.Tensor) -> bool:
    return "proj" in name and p.ndim == 2


def make_model(args: argparse.Namespace) -> TinyMLP:
    torch.manual_seed(0)  # identical init on every rank and for every configuration
    return TinyMLP(args.d, args.ff, args.layers)


def make_batch(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(args.batch, args.d, generator=g)


def shard_all(model: TinyMLP, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ---- the naive baseline ----------------------------------------------------------------------------------
def _adjusted_lr(lr: float, shape) -> float:
    """torch.optim.Muon's "match_rms_adamw" scaling (dmuon.Muon's default)."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class NaiveFSDP2Muon(torch.optim.Optimizer):
    """Muon on FSDP2-sharded matrices the naive way; torch AdamW (foreach) on every other param.

    Per Muon matrix and step: all-gather the grad shard, update a full-size momentum buffer (kept on every
    rank), run the same fp32 Newton-Schulz as every other rank, apply this rank's rows of the update.
    Update rule = dmuon.Muon's defaults (EMA momentum, Nesterov, no weight decay, match_rms_adamw lr).
    """

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter]):
        super().__init__([{"params": muon_params}], dict(lr=MUON_LR, momentum=MOMENTUM))
        self.adamw = torch.optim.AdamW(adamw_params, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                       weight_decay=ADAMW_WD, foreach=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from titan_dmuon.dmuon.newton_schulz import zeropower_via_newtonschulz

        self.adamw.step()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.full_tensor()  # all-gather of the averaged grad shards
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu)
                ortho = zeropower_via_newtonschulz(update, ns_steps=NS_STEPS, coefficients=NS_COEFFS,
                                                   eps=NS_EPS, dtype=torch.float32)
                local = p.to_local()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                rows = ortho[offset[0]: offset[0] + shape[0]]
                local.add_(rows.to(local.dtype), alpha=-_adjusted_lr(lr, p.shape))
        return None


# ---- the three configurations ----------------------------------------------------------------------------
def build_dmuon(mesh, args: argparse.Namespace, z3: bool = True):
    from titan_dmuon import dmuon

    model = make_model(args)
    dmuon.dedicate_params(model, mesh, predicate=is_muon_target, reshard_after_forward=z3)
    shard_all(model, mesh)
    opt = dmuon.Muon(model, lr=MUON_LR, adamw_lr=ADAMW_LR, ns_coefficients=NS_COEFFS)
    return model, opt


def build_naive(mesh, args: argparse.Namespace):
    model = make_model(args)
    shard_all(model, mesh)
    named = list(model.named_parameters())
    muon = [p for n, p in named if is_muon_target(n, p)]
    rest = [p for n, p in named if not is_muon_target(n, p)]
    return model, NaiveFSDP2Muon(muon, rest)


def build_adamw(mesh, args: argparse.Namespace):
    model = make_model(args)
    shard_all(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                            weight_decay=ADAMW_WD, foreach=True)
    return model, opt


# ---- measurement -----------------------------------------------------------------------------------------
def timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """One training step after a barrier; returns the loss and [total, fwd, bwd, step, dmuon NS] seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = model(x)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    ns = getattr(opt, "last_step_stats", {}).get("ns_time_s", 0.0)  # DMuon's own Muon-update timer
    return loss.detach(), [t3 - t0, t1 - t0, t2 - t1, t3 - t2, ns]


def run_interleaved(runs: dict, args: argparse.Namespace, rank: int) -> dict:
    """Warmup + timed steps, round-robin over the configurations (step s of every config, then s+1, ...).

    Interleaving makes the ratios robust to background load that drifts during the run. Per config:
    mean over timed steps of the max over ranks of total/fwd/bwd/step/NS seconds, and the final mean loss.
    """
    sums = {name: torch.zeros(5, dtype=torch.float64) for name in runs}
    losses = {}
    for step in range(args.warmup + args.steps):
        x = make_batch(step, rank, args)
        for name, (model, opt) in runs.items():
            losses[name], phases = timed_step(model, opt, x)
            if step >= args.warmup:
                t = torch.tensor(phases, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                sums[name] += t
    results = {}
    for name in runs:
        loss = losses[name].clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        mean = (sums[name] / args.steps).tolist()
        results[name] = dict(total=mean[0], fwd=mean[1], bwd=mean[2], step=mean[3], ns=mean[4],
                             loss=loss.item())
    return results


def dmuon_resident_ratio(model: nn.Module, opt: torch.optim.Optimizer, world: int) -> float:
    """Max over ranks of (owned params + momentum + live packed buffers) bytes, over 2*4*P_M/N."""
    st = model._dmuon_state
    resident = 0
    for dp in st.dparams:
        if dp._owned_data is not None:
            resident += dp._owned_data.numel() * dp._owned_data.element_size()
        buf = opt.state[dp.param].get("momentum_buffer") if dp.param in opt.state else None
        if buf is not None:
            resident += buf.numel() * buf.element_size()
    for g in st.groups:
        resident += g.buffer.untyped_storage().nbytes()
    t = torch.tensor([resident], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    p_m = sum(dp.numel for dp in st.dparams)
    return t.item() / (2 * 4 * p_m / world)


def naive_resident_ratio(model: nn.Module, opt: NaiveFSDP2Muon, world: int) -> float:
    """Same accounting for the naive baseline: local Muon-target shards + full-size momentum buffers."""
    resident, p_m = 0, 0
    for p in opt.param_groups[0]["params"]:
        local = p.to_local()
        resident += local.numel() * local.element_size()
        buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
        if buf is not None:
            resident += buf.numel() * buf.element_size()
        p_m += p.numel()
    t = torch.tensor([resident], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / (2 * 4 * p_m / world)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        builders: list[tuple[str, Callable]] = [("dmuon", lambda: build_dmuon(mesh, args, z3=True))]
        if args.z2:
            builders.append(("dmuon_z2", lambda: build_dmuon(mesh, args, z3=False)))
        builders += [("naive_fsdp2_muon", lambda: build_naive(mesh, args)),
                     ("fsdp2_adamw", lambda: build_adamw(mesh, args))]
        runs = {name: build() for name, build in builders}
        load_before = os.getloadavg()[0]
        results = run_interleaved(runs, args, rank)
        resident = {}  # after the last step
        for name, (model, opt) in runs.items():
            if name.startswith("dmuon"):
                resident[name] = dmuon_resident_ratio(model, opt, world)
            elif name == "naive_fsdp2_muon":
                resident[name] = naive_resident_ratio(model, opt, world)
        load = (load_before, os.getloadavg()[0])
        dist.barrier()
        if rank == 0:
            report(results, resident, load, world, args)
    finally:
        dist.destroy_process_group()


def report(results: dict, resident: dict, load: tuple, world: int, args: argparse.Namespace) -> None:
    ms = 1e3
    print(f"bench_step: N={world} gloo ranks x 1 thread on {os.cpu_count()} CPUs, d={args.d} ff={args.ff} "
          f"layers={args.layers} batch={args.batch}; {args.steps} timed steps after {args.warmup} warmup, configs "
          f"interleaved step by step; per step max over ranks, then mean")
    print(f"1-min load average: {load[0]:.2f} before the steps, {load[1]:.2f} after")
    print(f"{'config':<18}{'step ms':>10}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}{'NS ms*':>9}"
          f"{'final loss':>13}{'resident/ideal':>16}")
    for name, r in results.items():
        ns = f"{r['ns'] * ms:9.1f}" if name.startswith("dmuon") else f"{'-':>9}"
        res = f"{resident[name]:15.2f}x" if name in resident else f"{'-':>16}"
        print(f"{name:<18}{r['total'] * ms:10.1f}{r['fwd'] * ms:9.1f}{r['bwd'] * ms:9.1f}{r['step'] * ms:9.1f}"
              f"{ns}{r['loss']:13.6f}{res}")
    print("* NS ms: DMuon's own timer of its owner-side momentum+NS+update (part of opt ms). resident/ideal "
          "(after the last step): Muon-matrix params + momentum bytes, max over ranks / (2*4*P_M/N).")
    d, n, a = results["dmuon"]["total"], results["naive_fsdp2_muon"]["total"], results["fsdp2_adamw"]["total"]
    z2 = ""
    if "dmuon_z2" in results:
        z2 = f"dmuon_z2 {results['dmuon_z2']['total'] * ms:.1f} ms, "
    print(f"bench_step N={world} d={args.d} ff={args.ff} layers={args.layers}: dmuon {d * ms:.1f} ms, {z2}"
          f"naive_fsdp2_muon {n * ms:.1f} ms, fsdp2_adamw {a * ms:.1f} ms | naive/dmuon {n / d:.2f}x, "
          f"dmuon/adamw {d / a:.2f}x | dmuon Z3 resident/ideal {resident['dmuon']:.2f}x", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="number of gloo ranks (default 4)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warmup steps per configuration (default 3)")
    p.add_argument("--d", type=int, default=256, help="model width (default 256)")
    p.add_argument("--ff", type=int, default=1024, help="MLP hidden width (default 1024)")
    p.add_argument("--layers", type=int, default=4, help="number of blocks (default 4)")
    p.add_argument("--batch", type=int, default=8, help="rows of input per rank (default 8)")
    p.add_argument("--z2", action="store_true", help="also time DMuon-Z2 (reshard_after_forward=False)")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--nproc and --steps must be >= 1, --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    mp.start_processes(worker, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True,
                       start_method="spawn")


if __name__ == "__main__":
    main()
