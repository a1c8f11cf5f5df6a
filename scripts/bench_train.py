"""End-to-end training throughput of the optimizers dmuon, muon_naive and adamw, or of variants of one optimizer
(e.g. DMuon's two TP gather modes): train.py on N CPU ranks.

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

Variants (`--variants NAME:FLAGS ...`) run each optimizer given (default then: dmuon alone) once per variant, with
that variant's train.py flags added (FLAGS split as a shell would, so `NAME:--a.b=c --d.e f` passes two flags;
an empty FLAGS runs the config as is), all alternating per repeat like the optimizers. The step time of each
measured step is the tokens it processed per rank (from `progress/tokens_seen`) over its tokens/s; a variant's
figure is the mean over the measured steps of all its repeats. The first variant is the reference. DMuon's TP
gather modes on dp_shard 2 x tp 2:

    python3 scripts/bench_train.py --steps 20 --warmup 5 --repeats 3 \
        --variants backward:--optimizer.dmuon.tp_gather=backward step:--optimizer.dmuon.tp_gather=step \
        -- --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2

prints one line per variant, `variant backward: T tok/s/rank, M ms/step (median, min, max, N steps; per run
M1 M2 M3), 1-min load L0-L1` (the load before and after its runs: these are CPU runs, so other load on the machine
shows directly in the step times; compare the per-run means before trusting a ratio), then the summary
`bench_train: ... dmuon variants: backward M ms, step M' ms per step | step/backward = M'/M (step time) ...`, each
ratio a variant's mean step time over the reference's (above 1: slower than the reference).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMIZERS = ("dmuon", "muon_naive", "adamw")


@dataclass
class Steps:
    """The measured steps (after the warmup) of one or more runs: per-rank tokens/s and step time of each."""

    tps: list[float] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    run_ms: list[float] = field(default_factory=list)  # each run's mean step time

    def __iadd__(self, other: Steps) -> Steps:
        self.tps += other.tps
        self.ms += other.ms
        self.run_ms += other.run_ms
        return self


def run_once(optimizer: str, args: argparse.Namespace, dump: str, extra: Sequence[str] = ()) -> Steps:
    """Train once (train.py flags `extra` added); the per-step tokens/s and step times after the warmup steps."""
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
    return measured_steps(
        {e.step: e.value for e in ea.Scalars("throughput/tokens_per_sec")},
        {e.step: e.value for e in ea.Scalars("progress/tokens_seen")},
        args.warmup,
        args.nproc,
    )


def measured_steps(tps: dict[int, float], tokens_seen: dict[int, float], warmup: int, ranks: int) -> Steps:
    """Steps after `warmup`, from the per-step scalars (logged every step): tokens/s per rank, and the step time in
    ms, that step's tokens per rank (the growth of tokens_seen, counted over all `ranks`) over its tokens/s."""
    out = Steps()
    for step in sorted(s for s in tps if s > warmup):
        out.tps.append(tps[step])
        out.ms.append(1e3 * (tokens_seen[step] - tokens_seen[step - 1]) / ranks / tps[step])
    out.run_ms.append(sum(out.ms) / len(out.ms))
    return out


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
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per optimizer (and variant)")
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        choices=OPTIMIZERS,
        help="optimizer.name values to run (default: all three, or dmuon alone with --variants)",
    )
    p.add_argument(
        "--ns-dtypes",
        nargs="+",
        default=[""],
        choices=("", "float32", "bfloat16"),
        help="run dmuon and muon_naive once per optimizer.muon.ns_dtype given (labelled e.g. dmuon:bfloat16), "
        "interleaved with the rest; default: the config's",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="NAME:FLAGS",
        help="run each optimizer once per variant, NAME:FLAGS adding the train.py flags FLAGS (shell-split, quote "
        "several: 'step:--optimizer.dmuon.tp_gather step'); reports each variant's step time and its ratio to the "
        "first variant's",
    )
    p.add_argument("extra", nargs="*", help="more train.py flags (every run), after `--`")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    if args.optimizers is None:
        args.optimizers = ["dmuon"] if args.variants else list(OPTIMIZERS)
    if args.variants is not None:
        if len(args.ns_dtypes) > 1:
            p.error("--variants and several --ns-dtypes: put --optimizer.muon.ns_dtype in the variants instead")
        try:
            args.variants = parse_variants(args.variants)
        except ValueError as e:
            p.error(str(e))
    return args


def parse_variants(specs: Sequence[str]) -> dict[str, list[str]]:
    """`NAME:FLAGS` entries -> {name: train.py flags}, in order; FLAGS is split as a shell would (may be empty)."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition(":")
        name = name.strip()
        if not sep or not name or not all(c.isalnum() or c in "_-." for c in name):
            raise ValueError(f"--variants entry {spec!r}: expected NAME:FLAGS with NAME of letters, digits, _ - .")
        if name in variants:
            raise ValueError(f"--variants: {name!r} given twice")
        variants[name] = shlex.split(flags)
    if len(variants) < 2:
        raise ValueError("--variants: give at least two to compare")
    return variants


def runs_of(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """label -> (optimizer.name, extra train.py flags): the Muon optimizers once per --ns-dtypes entry; with
    --variants, every optimizer once per variant (labelled by the variant, `opt:variant` with several optimizers)."""
    runs = {}
    for opt in args.optimizers:
        for dtype in args.ns_dtypes if opt != "adamw" else [""]:
            dtype_flags = ["--optimizer.muon.ns_dtype", dtype] if dtype else []
            if args.variants is not None:
                for name, flags in args.variants.items():
                    runs[f"{opt}:{name}" if len(args.optimizers) > 1 else name] = (opt, dtype_flags + flags)
                continue
            label = f"{opt}:{dtype}" if dtype and len(args.ns_dtypes) > 1 else opt
            runs[label] = (opt, dtype_flags)
    return runs


def variant_lines(args: argparse.Namespace, steps: dict[str, Steps], loads: dict[str, list[float]]) -> list[str]:
    """One line per variant run (tokens/s, mean step time and its spread, load), then the summary: each variant's
    mean step time and, per optimizer, each variant's over the first variant's."""
    ms = {label: sum(s.ms) / len(s.ms) for label, s in steps.items()}
    lines = [
        f"variant {label}: {combined(s.tps):,.0f} tok/s/rank, {ms[label]:.1f} ms/step "
        f"(median {statistics.median(s.ms):.1f}, min {min(s.ms):.1f}, max {max(s.ms):.1f}, {len(s.ms)} steps; "
        f"per run {' '.join(f'{v:.1f}' for v in s.run_ms)}), 1-min load {min(loads[label]):.1f}-{max(loads[label]):.1f}"
        for label, s in steps.items()
    ]
    names = list(args.variants)
    ratios = []
    for opt in args.optimizers:
        prefix = f"{opt}:" if len(args.optimizers) > 1 else ""
        ref = prefix + names[0]
        ratios += [f"{prefix}{n}/{names[0]} = {ms[prefix + n] / ms[ref]:.3f}" for n in names[1:]]
    what = args.optimizers[0] if len(args.optimizers) == 1 else "/".join(args.optimizers)
    lines.append(
        f"{what} variants: " + ", ".join(f"{label} {v:.1f} ms" for label, v in ms.items()) + " per step"
        f" | {', '.join(ratios)} (step time)"
    )
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = runs_of(args)
    steps: dict[str, Steps] = {label: Steps() for label in runs}
    loads: dict[str, list[float]] = {label: [] for label in runs}  # 1-min load before and after each run
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for r in range(args.repeats):
            for i, (label, (opt, extra)) in enumerate(runs.items()):
                steps[label] += run_once(opt, args, os.path.join(tmp, f"{opt}{r}_{i}"), extra)
                loads[label] += [load[-1], os.getloadavg()[0]]
                load.append(loads[label][-1])
    head = (
        f"bench_train: {args.flavor}, {args.nproc} CPU ranks, {args.batch}x{args.seq_len} tokens/rank/step, "
        f"steps {args.warmup + 1}-{args.steps} x {args.repeats}: "
    )
    tail = f" ({time.perf_counter() - t0:.0f} s; 1-min load {min(load):.1f}-{max(load):.1f})"
    if args.variants is not None:
        *per_variant, summary = variant_lines(args, steps, loads)
        print("\n".join(per_variant))
        print(head + summary + tail)
        return
    rate = {label: combined(s.tps) for label, s in steps.items()}
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
        head
        + ", ".join(f"{opt} {v:,.0f}" for opt, v in rate.items())
        + " tok/s/rank"
        + (f" | {', '.join(ratios)}" if ratios else "")
        + tail
    )


if __name__ == "__main__":
    main()
