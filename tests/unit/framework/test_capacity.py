"""A real run's memory check on CUDA (`planner.check_device_memory`, called by the trainer before it allocates the
model), driven here with the free/total bytes a GPU would report: quiet with room to spare, a warning above 90%
of the free memory, a ConfigError naming the largest terms and the changes that fit when the plan does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, logging
from titan_dmuon import planner
from titan_dmuon.config import ConfigError, parse_args

warnings = []
handler = logging.Handler(level=logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("titan_dmuon.planner").addHandler(handler)
argv = ["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "64"]
cfg = parse_args(argv)
model, spec, dims, _ = planner.build_on_fake_world(cfg, 2)  # what a real rank builds on meta, placement included
memory, _, _ = planner.plan_memory(model, spec, dims, cfg)
peak = memory["peak_estimate"]["per_rank"][1]
out = {"peak": peak, "activations": memory["activations_estimate"]["max"]}
cases = {
    "roomy": (cfg, 2 * peak, None),
    "close": (cfg, peak / 0.95, None),
    "short": (cfg, 0.5 * peak, None),
    "another rank short": (cfg, 2 * peak, lambda ratio: 2.0),  # this rank fits, another's plan is 2x its free
    "short, check off": (parse_args([*argv, "--job.check_device_memory", "false"]), 0.5 * peak, None),
}
for name, (c, free, worst) in cases.items():
    warnings.clear()
    try:
        if worst is None:
            planner.check_device_memory(model, spec, dims, c, 1, free, 4 * peak)
        else:
            planner.check_device_memory(model, spec, dims, c, 1, free, 4 * peak, worst)
        out[name] = {"error": None, "warnings": list(warnings)}
    except ConfigError as e:
        out[name] = {"error": str(e), "warnings": list(warnings)}
print(json.dumps(out))
"""


def test_check_device_memory_against_the_free_memory_of_the_device() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["activations"] > 0.5 * out["peak"]  # a micro-batch of 64: the activations dominate
    assert out["roomy"] == {"error": None, "warnings": []}
    close = out["close"]
    assert close["error"] is None and any("95% of its free GPU memory" in w for w in close["warnings"]), close
    error = out["short"]["error"]
    assert error is not None and "does not fit" in error and "free on its GPU" in error, error
    assert "activations kept by the blocks" in error  # the largest term, named
    assert "--activation_checkpoint.mode full" in error and "--training.local_batch_size" in error, error
    # every rank decides alike: a rank whose own plan fits still stops when another's does not
    assert "another rank's memory plan does not fit" in out["another rank short"]["error"]
    off = out["short, check off"]
    assert off["error"] is None and any("it may not fit" in w for w in off["warnings"]), off
