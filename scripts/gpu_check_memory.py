"""The planner's per-rank peak against `torch.cuda.max_memory_allocated` on real steps (scripts/gpu_check.sh's memory
section). The planned figure is the dry run's (`train.py --job.dry_run`, `capacity.peak_bytes` of its JSON: the
`plan_memory` figure the trainer's device-memory check compares with the free memory); the measured one is the
CUDA caching allocator's peak over a few `train.py` steps of the same config in this process. Without CUDA it
prints the planned figure and says that the measured one needs a GPU.

    python scripts/gpu_check_memory.py                          # debug model, 3 steps on cuda:0
    python scripts/gpu_check_memory.py --config train_configs/debug_model.toml --steps 3 -- --training.seq_len 256

Fails when the step allocated more than the plan by over `--over` (default 25%) plus `--slack-mib` (64: the cuBLAS
workspaces and the allocator's rounding, which the plan does not count), or when the plan is over `--under` (4)
times the measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def planned_peak(config: str, extra: list[str], work: str) -> dict:
    """The dry run's capacity section (a fresh process: the planner makes its own fake process group)."""
    out = os.path.join(work, "plan.json")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, *extra]
    cmd += ["--job.dry_run", "true", "--job.dry_run_world_size", "1", "--job.dry_run_json", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 2) or not os.path.exists(out):  # 2: the plan does not fit its device (still planned)
        raise RuntimeError(f"dry run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)["capacity"]


def measured_peak(config: str, extra: list[str], steps: int, work: str) -> int:
    """torch.cuda.max_memory_allocated after `steps` steps of train.py's trainer in this process."""
    import torch

    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer, set_up_logging

    argv = ["--config", config, *extra, "--training.steps", str(steps), "--job.dump_folder", work]
    argv += ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
    cfg = parse_args(argv)
    set_up_logging()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--over", type=float, default=0.25, help="fail if measured > plan x (1 + over) + slack")
    parser.add_argument("--under", type=float, default=4.0, help="fail if plan > measured x under + slack")
    parser.add_argument("--slack-mib", type=float, default=64.0)
    parser.add_argument("--cpu", action="store_true", help="only the planned figure (what runs without CUDA)")
    parser.add_argument("extra", nargs="*", help="config flags for both (after --)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_check_memory.") as work:
        cap = planned_peak(args.config, args.extra, work)
        planned = float(cap["peak_bytes"])
        print(f"planned peak (train.py --job.dry_run, rank {cap['rank']}): {planned / MIB:.1f} MiB")
        import torch

        if args.cpu or not torch.cuda.is_available():
            print("measured peak: needs CUDA (torch.cuda.max_memory_allocated); not measured on this machine")
        else:
            measured = measured_peak(args.config, args.extra, args.steps, os.path.join(work, "run"))
            slack = args.slack_mib * MIB
            ratio = measured / planned if planned else float("inf")
            print(
                f"measured peak (torch.cuda.max_memory_allocated, {args.steps} steps on "
                f"{torch.cuda.get_device_name()}): {measured / MIB:.1f} MiB; measured / planned = {ratio:.3f}"
            )
            if measured > planned * (1 + args.over) + slack:
                print(f"FAIL: the plan under-estimates the step by more than {args.over:.0%} + {args.slack_mib} MiB")
                ok = False
            if planned > measured * args.under + slack:
                print(f"FAIL: the plan is more than {args.under}x the measured peak (+ {args.slack_mib} MiB)")
                ok = False
    if os.environ.get("GPU_CHECK_PLANTED"):
        print("FAIL: planted failure (GPU_CHECK_PLANTED)")
        ok = False
    print(f"memory: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
