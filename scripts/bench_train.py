"""End-to-end training throughput of the optimizers dmuon, muon_naive and adamw: train.py on N CPU ranks.

Runs `torchrun --standalone --nproc_per_node N train.py --config train_configs/debug_model.toml` once per
optimizer (`--optimizers`, default all three: DMuon, the naive FSDP2 + Muon baseline, plain AdamW), with the
same layout (1D FSDP2 by default), model, data and step count, logging every step to TensorBoard in a
temporary folder. Throughput is read back from the `throughput/tokens_per_sec` scalars (per-rank tokens/s of
each step): the warmup steps are dropped and the rest are combined as tokens / total time (the harmonic mean,
since every step carries the same tokens). The runs alternate `--repeats` times so that background load
drifting during the benchmark hits them alike.

    python3 scripts/bench_train.py                        # 4 ranks, debugmodel, 8 x 128 tokens/rank, 15 steps
    python3 scripts/bench_train.py --nproc 2 --steps 20 --warmup 5 -- --training.seq_len 256
    python3 scripts/bench_train.py --repeats 2 --optimizers dmuon adamw --ns-dtypes float32 bfloat16

Prints one summary line: `bench_train: ... dmuon X, muon_naive Y, adamw Z tok/s/rank | dmuon/muon_naive = R,
dmuon/adamw = S` (with several --ns-dtypes, each DMuon run against the baseline with the same NS dtype),
and the range of the 1-minute load average over the runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZERS = ("dmuon", "muon_naive", "adamw")


def run_once(optimizer: str, args: argparse.Namespace, dump: str, extra: Sequence[str] = ()) -> list[float]:
    """Train once (train.py flags `extra` added); the per-step tokens/s after the warmup steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        os.path.join(REPO, "train.py"),
        "--config",
        args.config,
        "--job.dump_folder",
        dump,
        "--optimizer.name",
        optimizer,
        "--model.flavor",
        args.flavor,
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(args.batch),
        "--training.seq_len",
        str(args.seq_len),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "true",
        *args.extra,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench_train: the {optimizer} run failed (exit {proc.returncode})")
    ea = EventAccumulator(os.path.join(dump, "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    return [e.value for e in ea.Scalars("throughput/tokens_per_sec") if e.step > args.warmup]


def combined(tps: list[float]) -> float:
    """Tokens/s over all the steps: equal tokens per step, so the harmonic mean of the per-step rates."""
    return len(tps) / sum(1.0 / x for x in tps)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--config", default=os.path.join(REPO, "train_configs", "debug_model.toml"))
    p.add_argument("--flavor", default="debugmodel", help="model flavor")
    p.add_argument("--steps", type=int, default=15, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the measurement")
    p.add_argument("--batch", type=int, default=8, help="local batch size (sequences per rank)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per optimizer")
    p.add_argument(
        "--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS, help="optimizer.name values to run"
    )
    p.add_argument(
        "--ns-dtypes",
        nargs="+",
        default=[""],
        choices=("", "float32", "bfloat16"),
        help="run dmuon and muon_naive once per optimizer.muon.ns_dtype given (labelled e.g. dmuon:bfloat16), "
        "interleaved with the rest; default: the config's",
    )
    p.add_argument("extra", nargs="*", help="more train.py flags, after `--`")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    return args


def runs_of(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """label -> (optimizer.name, extra train.py flags): the Muon optimizers once per --ns-dtypes entry."""
    runs = {}
    for opt in args.optimizers:
        for dtype in args.ns_dtypes if opt != "adamw" else [""]:
            label = f"{opt}:{dtype}" if dtype and len(args.ns_dtypes) > 1 else opt
            runs[label] = (opt, ["--optimizer.muon.ns_dtype", dtype] if dtype else [])
    return runs


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = runs_of(args)
    tps: dict[str, list[float]] = {label: [] for label in runs}
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for r in range(args.repeats):
            for label, (opt, extra) in runs.items():
                tps[label] += run_once(opt, args, os.path.join(tmp, f"{opt}{r}{label}"), extra)
                load.append(os.getloadavg()[0])
    rate = {label: combined(v) for label, v in tps.items()}
    ratios = []
    for label in rate:
        if label.startswith("dmuon"):
            suffix = label.removeprefix("dmuon")  # vs the baseline with the same NS dtype, and vs AdamW
            ratios += [
                f"{label}/{other} = {rate[label] / rate[other]:.3f}"
                for other in (f"muon_naive{suffix}", "adamw")
                if other in rate
            ]
    print(
        f"bench_train: {args.flavor}, {args.nproc} CPU ranks, {args.batch}x{args.seq_len} tokens/rank/step, "
        f"steps {args.warmup + 1}-{args.steps} x {args.repeats}: "
        + ", ".join(f"{opt} {v:,.0f}" for opt, v in rate.items())
        + " tok/s/rank"
        + (f" | {', '.join(ratios)}" if ratios else "")
        + f" ({time.perf_counter() - t0:.0f} s; 1-min load {min(load):.1f}-{max(load):.1f})"
    )


if __name__ == "__main__":
    main()
