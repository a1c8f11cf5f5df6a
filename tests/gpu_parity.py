"""The DMuon parity runs of tests/distributed on up to N ranks of this backend (TITAN_DMUON_TEST_BACKEND,
tests/_dist.py), with the measured errors against the single-process reference; one PASS/FAIL line per run, SKIP
lines for the layouts N is too small for, exit 1 if any failed.

    TITAN_DMUON_TEST_BACKEND=nccl python -m tests.gpu_parity N    # scripts/gpu_check.sh, section (a)
    python -m tests.gpu_parity 2                                   # gloo, on CPU
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from tests import dmuon_tp_harness
from tests._dist import backend_name, run_distributed
from tests.dmuon_harness import assert_matches_reference, merge_momentum, parity_rtol, reference, train
from tests.reference import rel_err

STEPS = 8
failed = []


def errors(results, losses, norms, sd, momentum):
    """Worst relative error of each compared quantity, over ranks and steps."""
    err = dict(loss=0.0, grad_norm=0.0, weights=0.0, momentum=0.0)
    for r in results:
        for a, b in zip(r["losses"], losses, strict=True):
            err["loss"] = max(err["loss"], abs(a - b) / abs(b))
        for a, b in zip(r["norms"], norms, strict=True):
            err["grad_norm"] = max(err["grad_norm"], abs(a - b) / abs(b))
    assert set(results[0]["sd"]) == set(sd), "state dict keys differ"
    for k, v in sd.items():
        err["weights"] = max(err["weights"], rel_err(results[0]["sd"][k], v))
    for step, want in enumerate(momentum):
        got = merge_momentum([r["momentum"][step] for r in results])
        assert set(got) == set(want), f"step {step}: momentum of {sorted(set(got) ^ set(want))}"
        for k, v in want.items():
            err["momentum"] = max(err["momentum"], rel_err(got[k], v))
    return err


def run(name, world, fn):
    rtol = parity_rtol()
    t0 = time.perf_counter()
    try:
        err = fn()
        worst = max(err.values())
        status = "PASS" if worst <= rtol else "FAIL"
        figures = ", ".join(f"{k} {v:.1e}" for k, v in err.items())
        took = time.perf_counter() - t0
        print(f"{status} {name} on {world} rank(s): max rel err {figures} (rtol {rtol:g}) [{took:.0f} s]")
    except Exception:  # noqa: BLE001
        status = "FAIL"
        print(f"FAIL {name} on {world} rank(s) [{time.perf_counter() - t0:.0f} s]:\n{traceback.format_exc()}")
    if status != "PASS":
        failed.append(name)


def harness(layout, shape, **kw):
    def fn():
        world = 1
        for s in shape:
            world *= s
        results = run_distributed(train, world, layout, shape, STEPS, **kw)
        ref = reference(world, STEPS)
        assert_matches_reference(results, ref)  # the tests' own check, at this backend's tolerance
        return errors(results, ref["losses"], ref["norms"], ref["sd"], ref["momentum"])

    return fn


def tp(layout, shape):
    def fn():
        results = run_distributed(dmuon_tp_harness.tp_train, shape[0] * shape[1], layout, shape)
        losses, sd, norms, momentum = dmuon_tp_harness.tp_reference(shape[0])
        return errors(results, losses, norms, sd, momentum)

    return fn


def main(n):
    print(f"backend {backend_name()}, up to {n} rank(s), {STEPS} steps, norm-wise rtol {parity_rtol():g}")
    # TORCH_CUDA_SANITIZER is read when torch is imported (each rank's too: they inherit the environment); it
    # checks CUDA streams, so on CPU it has nothing to check. A race it finds raises in the rank: that run FAILs.
    sanitizer = "TORCH_CUDA_SANITIZER" in os.environ
    if backend_name() == "nccl":
        slow = os.environ.get("DMUON_DEBUG_SLOW_STREAMS_CYCLES", "") or "0"
        print(f"CUDA sanitizer {'on' if sanitizer else 'off'}; side streams slowed by {slow} GPU cycles per entry")
    else:
        print("CPU (gloo): no CUDA stream to sanitize or slow; the same parity runs without the sanitizer")
    run("1D FSDP2 Z3 (test_dmuon_fsdp)", n, harness("fsdp", (n,), z3=True))
    run("1D FSDP2 Z2 (test_dmuon_fsdp)", n, harness("fsdp", (n,), z3=False))
    if n >= 2:
        run("DDP, dmuon.replicate (test_dmuon_hsdp_ddp)", n, harness("ddp", (n,)))
        run(f"TP dp x tp = {n // 2} x 2 (test_dmuon_tp)", n // 2 * 2, tp("dp_tp", (n // 2, 2)))
    else:
        print("SKIP DDP (needs >= 2 GPUs)")
        print("SKIP TP (needs >= 2 GPUs: dp x tp = 1 x 2)")
    if n >= 4:
        run(f"HSDP 2 x {n // 2}, async publish (test_dmuon_hsdp_ddp)", n // 2 * 2, harness("hsdp", (2, n // 2)))
    else:
        print("SKIP HSDP (needs >= 4 GPUs: replicate x shard = 2 x 2)")
    if os.environ.get("GPU_CHECK_PLANTED"):  # scripts/gpu_check.sh GPU_CHECK_PLANT_FAIL=parity
        failed.append("planted failure (GPU_CHECK_PLANTED)")
    print(f"parity: {'PASS' if not failed else 'FAIL: ' + '; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":  # the ranks are spawned: they re-import this file as a module
    sys.exit(main(int(sys.argv[1])))
