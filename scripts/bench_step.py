"""Training-step time of DMuon vs naive FSDP2 + Muon vs FSDP2 + AdamW, on N real gloo ranks.

What it measures, in one run on the same N ranks (same TinyMLP init, same per-rank data, same
number of steps for every configuration):

  dmuon             the README's library pattern: dmuon.dedicate_params (Z3 by default) on the "proj" matrices,
                    fully_shard on each of dmuon.fsdp_units(model) (each layer is left with its LayerNorm only,
                    so none: the blocks train.py shards too, titan_dmuon.parallel.fsdp_blocks), then on the
                    model; dmuon.Muon(lr=0.02, adamw_lr=1e-3, ns_coefficients="muon").
  dmuon_z2          the same with reshard_after_forward=False (only with --z2).
  dmuon_1by1        dmuon with its owner Newton-Schulz one matrix a call (only with --one-by-one).
  dmuon_per_layer   dmuon with every layer fully_shard-ed (the older, slower pattern: each layer an FSDP2 unit
                    holding only its LayerNorm), then the root (only with --per-layer).
  naive_fsdp2_muon  every param fully_shard-ed by FSDP2 (the same loop: with nothing dedicated
                    dmuon.fsdp_units(model) is every layer, each a unit, then the root); at step time
                    each Muon-target grad shard is all-gathered (DTensor.full_tensor()), every rank runs
                    momentum + the same Newton-Schulz on the full matrix and applies its own shard of the
                    update; AdamW (foreach) on the rest: the `muon_naive` optimizer component's NaiveMuon
                    (titan_dmuon/components/optimizer/).
  fsdp2_adamw       FSDP2 + torch.optim.AdamW (foreach) on every param.
  hsdp_sync         (only with --hsdp R) DMuon on the HSDP mesh (R, N/R) = ("replicate", "shard"):
                    dedicate_params(model, mesh["shard"], replicate_mesh=mesh["replicate"]) (Z3), fully_shard
                    on the 2D mesh, dmuon.Muon(..., replicate_async=False): the replicate-axis publish of the
                    updated owner copies is issued and waited inside step().
  hsdp_async        the same with replicate_async=True: each group's publish is dispatched after its update
                    and waited in that group's next pre-forward (unshard).

All configurations are built up front and stepped round-robin (step s of each, then step s+1, ...), so
background load drifting during the run hits them alike. Step time = forward + backward + optimizer step
(zero_grad included), timed on every rank after a dist.barrier(), max over ranks per step, mean over the
timed steps (warmup steps excluded). The table also splits it into forward / backward / step (same
harness, max over ranks of each phase) and shows the 1-minute load average (other jobs on the machine).

With --hsdp R the two HSDP runs must end bitwise identical (async only moves the publish wait): the script
checks the final loss on every rank (and the full model state, dmuon.get_model_state_dict), prints it, and
prints the per-rank per-step DMuon ledger of the HSDP run (dmuon.comm_stats: elements by kind, counted as in
docs/dmuon.md, "Bytes per step") next to that section's HSDP formulas: shard reduce (G-1)/G*P_M, shard
broadcast 2(G-1)/G*P_M (Z3: forward + backward re-broadcast), replicate reduce and publish (R-1)/R*P_col
each, P_col = dedicated elements owned by the rank's shard column (summed over a replicate row of G ranks:
(R-1)/R*P_M). G = N/R is the shard size. The two reduces also carry one has-grad flag per matrix (M in all,
M_col in the rank's column): (G-1)/G*(P_M+M) and (R-1)/R*(P_col+M_col).

DMuon Z3 resident/ideal: after the last step, per rank, bytes of the fp32 master of each matrix the rank owns
(numel x 4: dmuon.get_owned_params) + their Muon momentum buffers + any packed group buffer storage still
allocated (the storage behind the dedicated params); max over ranks divided by 2 x 4 x P_M / N (fp32 params +
momentum of all dedicated matrices, spread evenly).

--device cuda runs the ranks on NCCL, rank r on cuda:r (one rank per GPU), with TF32 matmuls for the model
(the NS runs in DMuon's CUDA default, bf16), and synchronizes the GPU before each phase's clock. --trace DIR
then records --trace-steps more DMuon steps per rank with torch.profiler (CPU ops, and CUDA kernels on a GPU)
as DIR/dmuon_rank{r}.json, a chrome trace that scripts/trace_overlap.py reads (communication overlapped with
compute).

Run (spawns its own gloo ranks on a free localhost port; one CPU thread per rank):

    python3 scripts/bench_step.py                      # N=4, d=256, ff=1024, 4 layers, batch 8, 10 steps
    python3 scripts/bench_step.py --nproc 2 --z2       # also DMuon-Z2
    python3 scripts/bench_step.py --nproc 4 --hsdp 2   # also DMuon on HSDP (2, 2), sync and async publish
    python3 scripts/bench_step.py --ns-dtype bfloat16  # every Muon config's Newton-Schulz in bf16
    python3 scripts/bench_step.py --one-by-one         # also DMuon with its owner NS one matrix a call
    python3 scripts/bench_step.py --per-layer          # also DMuon with every layer its own FSDP2 unit
    python3 scripts/bench_step.py --nproc 4 --steps 10 --warmup 3 --d 256 --ff 1024 --layers 4 --batch 8
    python3 scripts/bench_step.py --device cuda --nproc 1 --d 2048 --ff 8192 --batch 4096 --trace /tmp/trace
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from titan_dmuon import dmuon  # noqa: E402
from titan_dmuon.components.optimizer import NaiveMuon  # noqa: E402
from titan_dmuon.models.tiny_mlp import TinyMLP, is_muon_target  # noqa: E402

# Hyper-parameters shared by every configuration (dmuon.Muon's defaults, spelled out for every optimizer).
MUON_LR, MOMENTUM, NS_STEPS, NS_COEFFS, NS_EPS = 0.02, 0.95, 5, "muon", 1e-7
ADAMW_LR, ADAMW_BETAS, ADAMW_EPS, ADAMW_WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


# ---- model and data (the quick start's TinyMLP) ---------------------------------------------------------
def rank_device(args: argparse.Namespace) -> torch.device:
    """CPU, or this rank's GPU (cuda:LOCAL_RANK) with --device cuda."""
    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")


def make_model(args: argparse.Namespace) -> TinyMLP:
    torch.manual_seed(0)  # identical init on every rank and for every configuration
    return TinyMLP(args.d, args.ff, args.layers).to(rank_device(args))


def ns_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """--ns-dtype for every Muon configuration alike (None: the library's default, fp32 on CPU, bf16 on CUDA)."""
    return getattr(torch, args.ns_dtype) if args.ns_dtype else None


def make_batch(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(args.batch, args.d, generator=g).to(rank_device(args))


def shard_all(model: TinyMLP, mesh, per_layer: bool = False) -> None:
    """FSDP2 exactly as README.md's library example (and examples/quickstart.py) applies it, after any
    dedicate_params: each of dmuon.fsdp_units(model) its own unit (every layer when nothing is dedicated; none
    under DMuon, where a layer keeps only its LayerNorm, which joins the root unit), then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers if per_layer else dmuon.fsdp_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ---- the three configurations ----------------------------------------------------------------------------
def dmuon_optimizer(model: nn.Module, args: argparse.Namespace, **options) -> dmuon.Muon:
    """dmuon.Muon with the shared hyper-parameters and --ns-dtype / --ns-max-batch-elements (`options` override;
    a None option is left to the library's default)."""
    kwargs = dict(
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        ns_coefficients=NS_COEFFS,
        ns_dtype=ns_dtype(args),
        ns_max_batch_elements=args.ns_max_batch_elements,
    )
    kwargs = {k: v for k, v in {**kwargs, **options}.items() if v is not None}
    return dmuon.Muon(model, **kwargs)


def build_dmuon(mesh, args: argparse.Namespace, z3: bool = True, max_batch: int | None = None, per_layer: bool = False):
    model = make_model(args)
    dmuon.dedicate_params(model, mesh, predicate=is_muon_target, reshard_after_forward=z3)
    shard_all(model, mesh, per_layer)
    return model, dmuon_optimizer(model, args, ns_max_batch_elements=max_batch or args.ns_max_batch_elements)


def build_dmuon_hsdp(mesh2d, args: argparse.Namespace, replicate_async: bool):
    """DMuon (Z3) on the ("replicate", "shard") mesh, as tests/dmuon_harness.py builds HSDP."""
    model = make_model(args)
    dmuon.dedicate_params(
        model, mesh2d["shard"], predicate=is_muon_target, replicate_mesh=mesh2d["replicate"], reshard_after_forward=True
    )
    shard_all(model, mesh2d)
    return model, dmuon_optimizer(model, args, replicate_async=replicate_async)


def build_naive(mesh, args: argparse.Namespace):
    model = make_model(args)
    shard_all(model, mesh)
    named = list(model.named_parameters())
    muon = [p for n, p in named if is_muon_target(n, p)]
    rest = [p for n, p in named if not is_muon_target(n, p)]
    opt = NaiveMuon(
        muon,
        rest,
        lr=MUON_LR,
        momentum=MOMENTUM,
        ns_steps=NS_STEPS,
        ns_coefficients=NS_COEFFS,
        eps=NS_EPS,
        adamw_lr=ADAMW_LR,
        adamw_betas=ADAMW_BETAS,
        adamw_eps=ADAMW_EPS,
        adamw_weight_decay=ADAMW_WD,
        ns_dtype=ns_dtype(args),
    )
    return model, opt


def build_adamw(mesh, args: argparse.Namespace):
    model = make_model(args)
    shard_all(model, mesh)
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WD, foreach=True
    )
    return model, opt


# ---- measurement -----------------------------------------------------------------------------------------
def _sync(x: torch.Tensor) -> None:
    """Wait for the GPU's queued work (a no-op on CPU), so that host clocks time the device's work."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """One training step after a barrier; returns the loss and [total, fwd, bwd, step, Muon NS] seconds. On a
    GPU each phase ends with a device synchronize (the phases cannot overlap each other's kernels)."""
    dist.barrier()
    _sync(x)
    t0 = time.perf_counter()
    loss = model(x)
    _sync(x)
    t1 = time.perf_counter()
    loss.backward()
    _sync(x)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    _sync(x)
    t3 = time.perf_counter()
    ns = getattr(opt, "last_step_stats", {}).get("ns_time_s", 0.0)  # the Muon optimizers' own NS timer
    return loss.detach(), [t3 - t0, t1 - t0, t2 - t1, t3 - t2, ns]


def run_interleaved(runs: dict, args: argparse.Namespace, rank: int) -> dict:
    """Warmup + timed steps, round-robin over the configurations (step s of every config, then s+1, ...).

    Interleaving makes the ratios robust to background load that drifts during the run. Per config:
    mean over timed steps of the max over ranks of total/fwd/bwd/step/NS seconds, and the final mean loss;
    for the HSDP runs also this rank's final loss and its DMuon ledger of every timed step.
    """
    sums = {name: torch.zeros(5, dtype=torch.float64) for name in runs}
    losses = {}
    ledgers = {name: [] for name in runs if name.startswith("hsdp")}
    for step in range(args.warmup + args.steps):
        x = make_batch(step, rank, args)
        for name, (model, opt) in runs.items():
            losses[name], phases = timed_step(model, opt, x)
            if step >= args.warmup:
                if name in ledgers:
                    ledgers[name].append(dmuon.comm_stats(model)["elements"])
                t = torch.tensor(phases, dtype=torch.float64, device=x.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                sums[name] += t.cpu()
    results = {}
    for name in runs:
        loss = losses[name].clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        mean = (sums[name] / args.steps).tolist()
        results[name] = dict(total=mean[0], fwd=mean[1], bwd=mean[2], step=mean[3], ns=mean[4], loss=loss.item())
        if name in ledgers:
            results[name].update(local_loss=losses[name], ledgers=ledgers[name])
    return results


def dedicated_params(model: nn.Module, world: int) -> list:
    """Every dedicated matrix of the model (each once, in FQN order): the union of every rank's owned ones."""
    by_fqn = {dp.fqn: dp for rank in range(world) for dp in dmuon.get_owned_params(model, rank)}
    return [by_fqn[fqn] for fqn in sorted(by_fqn)]


def dmuon_resident_ratio(model: nn.Module, opt: torch.optim.Optimizer, world: int) -> float:
    """Max over ranks of (owned fp32 masters + momentum + live packed buffers) bytes, over 2*4*P_M/N (1D)."""
    resident = 0
    for dp in dmuon.get_owned_params(model):
        resident += dp.numel * 4  # the owner's fp32 master copy
        buf = opt.state[dp.param].get("momentum_buffer") if dp.param in opt.state else None
        if buf is not None:
            resident += buf.numel() * buf.element_size()
    storages = {}  # the packed group buffers behind the dedicated params (empty once freed: Z3)
    for dp in dedicated_params(model, world):
        st = dp.param.untyped_storage()
        if st.nbytes():
            storages[st.data_ptr()] = st.nbytes()
    resident += sum(storages.values())
    t = torch.tensor([resident], dtype=torch.float64, device=rank_device(_ARGS))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    p_m = sum(dp.numel for dp in dedicated_params(model, world))
    return t.item() / (2 * 4 * p_m / world)


def naive_resident_ratio(model: nn.Module, opt: NaiveMuon, world: int) -> float:
    """Same accounting for the naive baseline: local Muon-target shards + full-size momentum buffers."""
    resident, p_m = 0, 0
    for group in opt.param_groups:
        if group["kind"] != "muon":
            continue
        for p in group["params"]:
            local = p.to_local()
            resident += local.numel() * local.element_size()
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            if buf is not None:
                resident += buf.numel() * buf.element_size()
            p_m += p.numel()
    t = torch.tensor([resident], dtype=torch.float64, device=rank_device(_ARGS))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / (2 * 4 * p_m / world)


def hsdp_checks(runs: dict, results: dict, mesh2d, world: int) -> dict:
    """Sync vs async bitwise (final loss, and the full state after draining the async publish, on every rank);
    gather the ledgers."""
    states = {name: dmuon.get_model_state_dict(runs[name][0]) for name in ("hsdp_sync", "hsdp_async")}
    s, a = results["hsdp_sync"], results["hsdp_async"]
    same_loss = torch.equal(s["local_loss"], a["local_loss"])
    ts, ta = states["hsdp_sync"], states["hsdp_async"]
    same_state = ts.keys() == ta.keys() and all(torch.equal(ts[k], ta[k]) for k in ts)
    flags = torch.tensor([int(same_loss), int(same_state)], device=rank_device(_ARGS))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    dps = dedicated_params(runs["hsdp_sync"][0], world)
    mine = dict(
        coord=(mesh2d.get_local_rank("shard"), mesh2d.get_local_rank("replicate")),
        shard_size=mesh2d["shard"].size(),
        replicate_size=mesh2d["replicate"].size(),
        z3=True,  # build_dmuon_hsdp: reshard_after_forward=True
        p_m=sum(dp.numel for dp in dps),
        p_col=sum(dp.numel for dp in dps if dp.in_owner_column),
        m=len(dps),  # the reduces carry one has-grad flag per matrix: M in all, M_col in the rank's column
        m_col=sum(1 for dp in dps if dp.in_owner_column),
        ledger=s["ledgers"][-1],
        steady=all(led == s["ledgers"][-1] for led in s["ledgers"]),  # the same every timed step
        async_same=a["ledgers"] == s["ledgers"],  # the async run's ledgers equal the sync run's, step by step
        local_loss=(s["local_loss"].item(), a["local_loss"].item()),
    )
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    return dict(loss_bitwise=bool(flags[0]), state_bitwise=bool(flags[1]), ranks=per_rank)


def trace_dmuon(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, rank: int) -> str:
    """--trace-steps more DMuon steps under torch.profiler; the chrome trace's path."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(args.trace_steps):
            with record_function(f"dmuon_step_{i}"):
                timed_step(model, opt, make_batch(args.warmup + args.steps + i, rank, args))
    os.makedirs(args.trace, exist_ok=True)
    path = os.path.join(args.trace, f"dmuon_rank{rank}.json")
    prof.export_chrome_trace(path)
    return path


_ARGS: argparse.Namespace  # this rank's arguments (set by `worker`): the device of the helpers' collectives


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    device = rank_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # the model's fp32 matmuls on tensor cores (NS: bf16)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh, mesh2d = init_device_mesh(device.type, (world,)), None
        builders: list[tuple[str, Callable]] = [("dmuon", lambda: build_dmuon(mesh, args, z3=True))]
        if args.z2:
            builders.append(("dmuon_z2", lambda: build_dmuon(mesh, args, z3=False)))
        if args.one_by_one:
            builders.append(("dmuon_1by1", lambda: build_dmuon(mesh, args, max_batch=args.d * args.ff)))
        if args.per_layer:
            builders.append(("dmuon_per_layer", lambda: build_dmuon(mesh, args, per_layer=True)))
        builders += [
            ("naive_fsdp2_muon", lambda: build_naive(mesh, args)),
            ("fsdp2_adamw", lambda: build_adamw(mesh, args)),
        ]
        if args.hsdp:
            shape2d = (args.hsdp, world // args.hsdp)
            mesh2d = init_device_mesh(device.type, shape2d, mesh_dim_names=("replicate", "shard"))
            builders += [
                ("hsdp_sync", lambda: build_dmuon_hsdp(mesh2d, args, replicate_async=False)),
                ("hsdp_async", lambda: build_dmuon_hsdp(mesh2d, args, replicate_async=True)),
            ]
        runs = {name: build() for name, build in builders}
        load_before = os.getloadavg()[0]
        results = run_interleaved(runs, args, rank)
        hsdp = hsdp_checks(runs, results, mesh2d, world) if args.hsdp else None
        resident = {}  # after the last step
        for name, (model, opt) in runs.items():
            if name.startswith("dmuon"):
                resident[name] = dmuon_resident_ratio(model, opt, world)
            elif name == "naive_fsdp2_muon":
                resident[name] = naive_resident_ratio(model, opt, world)
        load = (load_before, os.getloadavg()[0])
        dist.barrier()
        if rank == 0:
            report(results, resident, load, world, args, hsdp)
        if args.trace:  # after the report: a profiler that fails on this machine costs the trace alone
            trace = trace_dmuon(*runs["dmuon"], args, rank)
            if rank == 0:
                print(f"trace of {args.trace_steps} DMuon steps: {trace} (one file per rank)", flush=True)
    finally:
        dist.destroy_process_group()


def report_hsdp(hsdp: dict, results: dict, args: argparse.Namespace) -> bool:
    """Bitwise sync-vs-async check and the per-rank ledger next to the HSDP bytes formulas; returns whether all
    held."""
    ranks = hsdp["ranks"]
    R, G = ranks[0]["replicate_size"], ranks[0]["shard_size"]
    p_m, m, z3 = ranks[0]["p_m"], ranks[0]["m"], ranks[0]["z3"]
    s, a = results["hsdp_sync"]["loss"], results["hsdp_async"]["loss"]
    ok_bits = hsdp["loss_bitwise"] and hsdp["state_bitwise"] and s == a
    print(
        f"HSDP {R}x{G} (replicate x shard) final loss, mean over ranks: sync {s!r} ({s.hex()}), async {a!r} ({a.hex()})"
    )
    print(
        f"  bitwise equal: final loss on every rank {'yes' if hsdp['loss_bitwise'] else 'NO'}, mean "
        f"{'yes' if s == a else 'NO'}; final model state (dmuon.get_model_state_dict) on every rank "
        f"{'yes' if hsdp['state_bitwise'] else 'NO'}"
    )
    print(
        f"HSDP {R}x{G} DMuon ledger, elements per rank per step (ledger rule: (k-1)/k*P per collective "
        f"over k ranks), P_M={p_m}, {'Z3' if z3 else 'Z2'}; got (expected: docs/dmuon.md, Bytes per step, HSDP; "
        f"the reduces also carry one has-grad flag per matrix, M={m} in all, M_col in a column)"
    )
    kinds = ("broadcast", "reduce", "replicate_reduce", "replicate_broadcast")
    print(f"{'rank':>4} {'(shard,rep)':>11} {'P_col':>9}" + "".join(f"{k:>27}" for k in kinds) + "  check")
    ok_all = ok_bits
    for rank, r in enumerate(ranks):
        led, p_col = r["ledger"], r["p_col"]
        want = {
            "broadcast": (2 if z3 else 1) * (G - 1) / G * p_m,
            "reduce": (G - 1) / G * (p_m + m),
            "replicate_reduce": (R - 1) / R * (p_col + r["m_col"]),
            "replicate_broadcast": (R - 1) / R * p_col,
        }
        ok = all(math.isclose(led[k], want[k], rel_tol=1e-12, abs_tol=1e-9) for k in kinds)
        ok = ok and all(v == 0 for k, v in led.items() if k not in kinds) and r["steady"] and r["async_same"]
        ok_all = ok_all and ok
        cells = "".join(f"{f'{led[k]:.1f} ({want[k]:.1f})':>27}" for k in kinds)
        print(f"{rank:>4} {str(r['coord']):>11} {p_col:>9}{cells}  {'ok' if ok else 'MISMATCH'}")
    for row_i in range(R):
        row = [r for r in ranks if r["coord"][1] == row_i]
        sums = {k: sum(r["ledger"][k] for r in row) for k in ("replicate_reduce", "replicate_broadcast")}
        want = {"replicate_reduce": (R - 1) / R * (p_m + m), "replicate_broadcast": (R - 1) / R * p_m}
        ok = len(row) == G and all(math.isclose(v, want[k], rel_tol=1e-12, abs_tol=1e-9) for k, v in sums.items())
        ok_all = ok_all and ok
        print(
            f"  replicate row {row_i} ({len(row)} ranks): replicate_reduce {sums['replicate_reduce']:.1f} "
            f"((R-1)/R*(P_M+M) = {want['replicate_reduce']:.1f}), replicate_broadcast "
            f"{sums['replicate_broadcast']:.0f} ((R-1)/R*P_M = {want['replicate_broadcast']:.0f})  "
            f"{'ok' if ok else 'MISMATCH'}"
        )
    steady = all(r["steady"] for r in ranks)
    same = all(r["async_same"] for r in ranks)
    print(
        f"  ledger the same every timed step: {'yes' if steady else 'NO'}; async run's ledger equal to the "
        f"sync run's, step by step: {'yes' if same else 'NO'}"
    )
    return ok_all


def report(
    results: dict, resident: dict, load: tuple, world: int, args: argparse.Namespace, hsdp: dict | None = None
) -> None:
    ms = 1e3
    where = (
        f"N={world} NCCL ranks on {torch.cuda.get_device_name()} GPUs (TF32 matmuls)"
        if args.device == "cuda"
        else f"N={world} gloo ranks x 1 thread on {os.cpu_count()} CPUs"
    )
    print(
        f"bench_step: {where}, d={args.d} ff={args.ff} "
        f"layers={args.layers} batch={args.batch} NS {args.ns_dtype or 'default dtype'}; {args.steps} timed steps "
        f"after {args.warmup} warmup, configs interleaved step by step; per step max over ranks, then mean"
    )
    print(f"1-min load average: {load[0]:.2f} before the steps, {load[1]:.2f} after")
    print(
        f"{'config':<18}{'step ms':>10}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}{'NS ms*':>9}"
        f"{'final loss':>13}{'resident/ideal':>16}"
    )
    for name, r in results.items():
        ns = f"{r['ns'] * ms:9.1f}" if name != "fsdp2_adamw" else f"{'-':>9}"
        res = f"{resident[name]:15.2f}x" if name in resident else f"{'-':>16}"
        print(
            f"{name:<18}{r['total'] * ms:10.1f}{r['fwd'] * ms:9.1f}{r['bwd'] * ms:9.1f}{r['step'] * ms:9.1f}"
            f"{ns}{r['loss']:13.6f}{res}"
        )
    print(
        "* NS ms: the optimizer's own timer of its Newton-Schulz runs (part of opt ms; DMuon: owner-side only). "
        "resident/ideal "
        "(after the last step): Muon-matrix params + momentum bytes, max over ranks / (2*4*P_M/N)."
    )
    hsdp_part, hsdp_ok = "", True
    if hsdp is not None:
        R, G = args.hsdp, world // args.hsdp
        print(
            f"hsdp_sync / hsdp_async: DMuon Z3 on the HSDP mesh ({R}, {G}) = (replicate, shard), "
            f"replicate_async=False / True"
        )
        hsdp_ok = report_hsdp(hsdp, results, args)
        hs, ha = results["hsdp_sync"]["total"], results["hsdp_async"]["total"]
        hsdp_part = f" | hsdp {R}x{G} sync {hs * ms:.1f} ms, async {ha * ms:.1f} ms (sync/async {hs / ha:.2f}x)" + (
            "" if hsdp_ok else " [HSDP CHECK FAILED]"
        )
    d, n, a = results["dmuon"]["total"], results["naive_fsdp2_muon"]["total"], results["fsdp2_adamw"]["total"]
    z2 = ""
    for extra in ("dmuon_z2", "dmuon_1by1", "dmuon_per_layer"):
        if extra in results:
            z2 += f"{extra} {results[extra]['total'] * ms:.1f} ms, "
    if "dmuon_per_layer" in results:
        z2 += f"naive/dmuon_per_layer {n / results['dmuon_per_layer']['total']:.2f}x, "
    print(
        f"bench_step N={world} d={args.d} ff={args.ff} layers={args.layers}: dmuon {d * ms:.1f} ms, {z2}"
        f"naive_fsdp2_muon {n * ms:.1f} ms, fsdp2_adamw {a * ms:.1f} ms | naive/dmuon {n / d:.2f}x, "
        f"dmuon/adamw {d / a:.2f}x | dmuon Z3 resident/ideal {resident['dmuon']:.2f}x{hsdp_part}",
        flush=True,
    )


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
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (NCCL, a GPU per rank)")
    p.add_argument(
        "--ns-dtype",
        default="",
        choices=("", "float32", "bfloat16"),
        help="Newton-Schulz dtype of every Muon config (default: the library's, fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument(
        "--ns-max-batch-elements",
        type=int,
        default=None,
        help="dmuon.Muon's bound on one batched owner NS call (default: the library's; d*ff: one matrix a call)",
    )
    p.add_argument("--trace", default="", metavar="DIR", help="also write a torch.profiler chrome trace per rank here")
    p.add_argument("--trace-steps", type=int, default=3, help="DMuon steps in the trace (default 3)")
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="also time DMuon with its owner NS one matrix a call (dmuon_1by1: ns_max_batch_elements = d*ff)",
    )
    p.add_argument("--z2", action="store_true", help="also time DMuon-Z2 (reshard_after_forward=False)")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="also time DMuon with every layer its own FSDP2 unit (dmuon_per_layer: the slower, older pattern)",
    )
    p.add_argument(
        "--hsdp",
        type=int,
        default=0,
        metavar="R",
        help="also time DMuon on the HSDP mesh (R, nproc/R), sync and async replicate publish",
    )
    args = p.parse_args(argv)
    if args.nproc < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--nproc and --steps must be >= 1, --warmup >= 0")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        p.error(f"--device cuda puts one rank on each GPU: --nproc {args.nproc} > {torch.cuda.device_count()} GPUs")
    if args.hsdp and (args.hsdp < 1 or args.nproc % args.hsdp):
        p.error(f"--hsdp R must be >= 1 and divide --nproc ({args.nproc}); got {args.hsdp}")
    return args


def main() -> None:
    args = parse_args()
    mp.start_processes(worker, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
