"""QK-clip on the debug model: the max-logit curves with and without the clip, and what measuring and clipping cost.

    python3 scripts/bench_qk_clip.py                  # curves of 150 steps, tau 30; cost from 3 x 40 steps each
    python3 scripts/bench_qk_clip.py --steps 60 --tau 10 --repeat 1

Runs train.py on the debug config (the same data, seed and lrs), one process at a time, in three settings:
  off      QK-clip off and the metric off: today's step, measuring nothing;
  measure  `metrics.log_max_logit`: the largest logit of each head measured and logged, nothing clipped;
  clip     `optimizer.muon.qk_clip_tau` = tau.
Curves: `measure` and `clip` for --steps steps; prints attn/max_logit every 10 steps, the unclipped run's last and
largest max logit, the clipped run's largest and its mean over the last third of the steps, and how far any step
went over tau (the clip acts on the next step's weights, so a step may overshoot). Cost: --repeat rounds of the three
settings in turn, --cost-steps steps each; each setting's step time is its fastest round's (training seconds past
the first 10 steps, from progress/elapsed_s: a shared CPU's noise only ever slows a round), printed as a ratio to off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(name: str, dump: Path, steps: int, *extra: str) -> dict[str, dict[int, float]]:
    from tests.train_runs import read_scalars

    argv = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug_model.toml")]
    argv += ["--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", str(dump / name), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return read_scalars(dump / name / "tb")


def step_seconds(scalars: dict[str, dict[int, float]], steps: int, skip: int = 10) -> float:
    """Mean training seconds per step past the first `skip` (start-up and warm-up excluded)."""
    elapsed = scalars["progress/elapsed_s"]
    return (elapsed[steps] - elapsed[skip]) / (steps - skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--tau", type=float, default=30.0)
    parser.add_argument("--cost-steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    settings = {
        "off": (),
        "measure": ("--metrics.log_max_logit", "true"),
        "clip": ("--optimizer.muon.qk_clip_tau", str(args.tau)),
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        measured = run("measure", dump, args.steps, *settings["measure"])
        clipped = run("clip", dump, args.steps, *settings["clip"])
        for i in range(args.repeat):
            for name, extra in settings.items():
                scalars = run(f"{name}{i}", dump, args.cost_steps, *extra)
                assert (name == "off") != ("attn/max_logit" in scalars), f"{name} measured" if name == "off" else name
                times[name].append(step_seconds(scalars, args.cost_steps))
    free, held = measured["attn/max_logit"], clipped["attn/max_logit"]
    print(f"{'step':>5} {'unclipped':>10} {'clipped':>10} {'clipped heads':>14}")
    for step in [1, *range(10, args.steps + 1, 10)]:
        heads = clipped["attn/clipped_heads"][step]
        print(f"{step:>5} {free[step]:>10.2f} {held[step]:>10.2f} {heads:>14.0f}")
    tail = [held[s] for s in range(args.steps - args.steps // 3 + 1, args.steps + 1)]
    over = max(held.values()) / args.tau - 1
    t_off, t_measure, t_clip = (min(times[name]) for name in settings)
    print(
        f"bench_qk_clip: tau {args.tau:g} | unclipped last {free[args.steps]:.1f} max {max(free.values()):.1f} | "
        f"clipped max {max(held.values()):.2f} ({100 * over:+.1f}% of tau) last-third mean {sum(tail) / len(tail):.2f} "
        f"| loss unclipped {measured['loss/train'][args.steps]:.4f} clip {clipped['loss/train'][args.steps]:.4f} | "
        f"step s off {t_off:.3f} measure/off {t_measure / t_off:.3f} clip/off {t_clip / t_off:.3f}"
    )


if __name__ == "__main__":
    main()
