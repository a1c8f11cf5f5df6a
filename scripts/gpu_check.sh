#!/usr/bin/env bash
# One prepared check of the GPU path on a machine with 1-8 NVIDIA GPUs (issues 13 and 14), in under 8 minutes
# on one GPU. Run from anywhere, as is:
#
#     bash scripts/gpu_check.sh                            # a GPU machine; the log also goes to $OUT/gpu_check.log
#     GPU_CHECK_ALLOW_CPU=1 bash scripts/gpu_check.sh      # no GPU: every section on CPU/gloo, tiny sizes
#     GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_RANKS=4 bash scripts/gpu_check.sh   # ... on 4 gloo ranks
#     GPU_CHECK_ONLY=a,c bash scripts/gpu_check.sh         # only these sections (compat, a, b, c, d, e)
#
# Sections, each under its own timeout and inside one time budget (GPU_CHECK_BUDGET_S, default 450 s); a failing
# section prints FAIL and the next one runs:
#   env     GPUs (nvidia-smi -L), python, torch, triton; wheels from .whl/ for what the machine lacks
#   compat  the torch APIs this code relies on (private FSDP2/DTensor ones included) on this torch
#   (a) parity   the DMuon parity runs of tests/distributed on NCCL (TITAN_DMUON_TEST_BACKEND=nccl, one rank per
#                GPU, TF32 off, fp32 NS) against the single-process torch.optim.Muon reference: 1D FSDP2 (Z3, Z2)
#                on every GPU, DDP on >= 2, TP (dp x 2) on >= 2, HSDP (2, N/2) on >= 4; SKIP lines otherwise.
#                The test suite's own driver runs them (python -m tests.gpu_parity N): this script imports no test
#   (b) step     scripts/bench_step.py: DMuon vs naive FSDP2 + Muon vs FSDP2 + AdamW ms/step, with a trace
#   (c) overlap  scripts/trace_overlap.py on that trace: DMuon's NCCL time overlapped with compute
#   (d) ns       scripts/bench_ns.py --check: the Triton kernels on the GPU against float64, get_ns_backend and
#                what kernel="auto" picks, then NS time for Llama-3 8B/70B shapes (torch vs Triton, direct vs
#                Gram, one by one vs batched, bf16)
#   (e) train    train.py, debug model, 20 steps on the GPU: the last loss lines and tokens/s; then
#                scripts/generate.py from its checkpoint (bf16, KV cache): the text and tokens/s
# With no NVIDIA GPU and no GPU_CHECK_ALLOW_CPU=1 it prints "no NVIDIA GPU found" and exits 0.

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    TEE_PID=$!
fi
# finish RC: wait for tee to write the whole log before the script (and so the caller's collection of $OUT) ends
finish() {
    if [ -n "${TEE_PID:-}" ]; then
        exec >&- 2>&-
        wait "$TEE_PID" 2>/dev/null
    fi
    exit "$1"
}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET_S:-450}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
START=$SECONDS
FAILED=()

echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on ${HOSTNAME:-?}, repo $ROOT ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

NGPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L
    NGPU=$(nvidia-smi -L | grep -c '^GPU')
fi
if [ "$NGPU" -eq 0 ]; then
    if [ "${GPU_CHECK_ALLOW_CPU:-0}" != "1" ]; then
        echo "no NVIDIA GPU found: nothing to check (GPU_CHECK_ALLOW_CPU=1 runs every section on CPU/gloo, tiny sizes)"
        finish 0
    fi
    MODE=cpu
    N=${GPU_CHECK_RANKS:-1}
    echo "no NVIDIA GPU found; GPU_CHECK_ALLOW_CPU=1: every section on CPU/gloo with tiny sizes, $N rank(s)"
else
    MODE=cuda
    N=${GPU_CHECK_RANKS:-$NGPU}
    [ "$N" -gt 8 ] && N=8
fi

# ---- environment: the packages this machine lacks travel as wheels in .whl/ -------------------------------
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import tyro, torchdata" >/dev/null 2>&1; then
    SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
    if ls .whl/*.whl >/dev/null 2>&1 &&
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
        export PYTHONPATH=$SITE:$PYTHONPATH # the wheels hold no torch: the machine's own torch stays
        echo "installed into $SITE: $(cd .whl && ls -- *.whl | tr '\n' ' ')"
    else
        echo "FAIL env: tyro/torchdata missing and no usable wheels in .whl/ (train.py and the config will fail)"
        FAILED+=(env)
    fi
fi
"$PY" - <<'EOF' || FAILED+=(env)
import sys

import torch

print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import triton

    print(f"triton {triton.__version__}")
except Exception as e:  # noqa: BLE001
    print(f"triton: does not import ({type(e).__name__}: {e})")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    print(f"NCCL {torch.cuda.nccl.version()}")
else:
    print("torch sees no CUDA device")
EOF
echo "mode $MODE, $N rank(s); time budget ${BUDGET} s for the sections; scratch $WORK"

# section NAME TIMEOUT_S CMD...: runs CMD under min(TIMEOUT_S, what is left of the budget); OK or FAIL.
section() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    echo
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",$GPU_CHECK_ONLY," != *",${name%%:*},"* ]]; then
        echo "==== [$name] not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
        return
    fi
    if [ "$left" -lt 15 ]; then
        echo "==== [$name] SKIP: out of the time budget (${BUDGET} s)"
        FAILED+=("$name(skipped)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "==== [$name] (timeout ${limit} s)"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "==== [$name] OK ($((SECONDS - t0)) s)"
    else
        local why=""
        [ "$rc" -eq 124 ] && why=", timed out"
        echo "==== [$name] FAIL (exit $rc$why, $((SECONDS - t0)) s)"
        FAILED+=("$name")
    fi
}

# ---- compat: the torch APIs the code relies on, on this torch ----------------------------------------------
cat >"$WORK/compat.py" <<'EOF'
"""Each torch API titan_dmuon relies on (its private FSDP2/DTensor ones too), present on this torch or not."""
import importlib
import inspect

import torch

print(f"torch {torch.__version__}; the project pins torch 2.13 (pyproject.toml): a MISSING line names what breaks")
ok = True


def check(what, fn):
    global ok
    try:
        res = fn()
        print(f"  ok       {what}" + (f": {res}" if res not in (None, True) else ""))
    except Exception as e:  # noqa: BLE001
        ok = False
        print(f"  MISSING  {what}: {type(e).__name__}: {e}")


def sig_has(obj, name):
    params = inspect.signature(obj).parameters
    assert name in params, f"no '{name}' in {list(params)}"


def attr(module, name):
    return getattr(importlib.import_module(module), name)


check("fully_shard(ignored_params=)", lambda: sig_has(attr("torch.distributed.fsdp", "fully_shard"), "ignored_params"))
check(
    "fsdp._fully_shard._fsdp_init._get_managed_states(modules, ignored_params) (dmuon/fsdp2_patch.py)",
    lambda: sig_has(attr("torch.distributed.fsdp._fully_shard._fsdp_init", "_get_managed_states"), "ignored_params"),
)
check(
    "dist._coalescing_manager(async_ops=) (dmuon/comm.py)",
    lambda: sig_has(attr("torch.distributed", "_coalescing_manager"), "async_ops"),
)
check(
    "tensor._utils.compute_local_shape_and_global_offset (components/checkpoint/hf_io.py)",
    lambda: attr("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset") and None,
)
check(
    "tensor.placement_types._StridedShard(split_factor=) (components/initialization.py, checkpoint/hf_io.py)",
    # built from C++ on some versions (no Python signature to inspect): construct one instead
    lambda: attr("torch.distributed.tensor.placement_types", "_StridedShard")(0, split_factor=2) and None,
)
check("torch.optim.Muon (tests' reference)", lambda: attr("torch.optim", "Muon") and None)
check(
    "torch.optim._muon._zeropower_via_newtonschulz (tests/reference.py patches it)",
    lambda: attr("torch.optim._muon", "_zeropower_via_newtonschulz") and None,
)
check("torch.optim.adamw.adamw (dmuon.muon.adamw_step)", lambda: attr("torch.optim.adamw", "adamw") and None)
check(
    "checkpoint.state_dict get/set_optimizer_state_dict",
    lambda: attr("torch.distributed.checkpoint.state_dict", "set_optimizer_state_dict") and None,
)
check("torch._C._current_graph_task_id", lambda: attr("torch._C", "_current_graph_task_id") and None)
check("testing._internal.distributed.fake_pg.FakeStore (dry run)", lambda: attr(
    "torch.testing._internal.distributed.fake_pg", "FakeStore") and None)
check("import titan_dmuon.dmuon (installs the FSDP2 patch)", lambda: importlib.import_module("titan_dmuon.dmuon") and None)
check("import titan_dmuon.trainer (tyro, torchdata, tensorboard)", lambda: importlib.import_module("titan_dmuon.trainer") and None)
print(f"compat: {'PASS' if ok else 'FAIL'}")
raise SystemExit(0 if ok else 1)
EOF
section compat 90 "$PY" "$WORK/compat.py"

# ---- (a) parity on NCCL (gloo on CPU) ----------------------------------------------------------------------
if [ "$MODE" = cuda ]; then
    section "a: parity on NCCL" $((150 + 20 * N)) env TITAN_DMUON_TEST_BACKEND=nccl "$PY" -m tests.gpu_parity "$N"
else
    section "a: parity on gloo (CPU)" 300 env TITAN_DMUON_TEST_BACKEND=gloo "$PY" -m tests.gpu_parity "$N"
fi

# ---- (b) step time, with a trace; (c) the overlap in that trace ----------------------------------------------
if [ "$MODE" = cuda ]; then
    STEP_ARGS=(--device cuda --nproc "$N" --d 2048 --ff 8192 --layers 4 --batch 4096 --steps 10 --warmup 3)
else
    STEP_ARGS=(--device cpu --nproc "$N" --d 64 --ff 128 --layers 2 --batch 8 --steps 3 --warmup 1)
fi
section "b: DMuon vs FSDP2+AdamW step time" 120 "$PY" scripts/bench_step.py "${STEP_ARGS[@]}" --trace "$WORK/trace"
if [ "$N" -eq 1 ]; then
    echo "note: world size 1: DMuon's broadcasts and reduces span one rank, so there is no real communication to"
    echo "      overlap; the overlap figure needs >= 2 GPUs (the trace still shows the step's kernels)"
fi
section "c: communication overlapped with compute" 60 \
    bash -c "$PY scripts/trace_overlap.py --world-size $N $WORK/trace/dmuon_rank*.json"
if [ -n "${OUT:-}" ] && [ -f "$WORK/trace/dmuon_rank0.json" ]; then
    gzip -c "$WORK/trace/dmuon_rank0.json" >"$OUT/dmuon_rank0_trace.json.gz" &&
        echo "trace of rank 0 kept as $OUT/dmuon_rank0_trace.json.gz"
fi

# ---- (d) Newton-Schulz: the Triton kernels on the GPU, the backend, time per shape --------------------------
if [ "$MODE" = cuda ]; then
    section "d: NS kernels + bench_ns" 170 "$PY" scripts/bench_ns.py --check --models 8B 70B --batch 4 --repeats 2
else
    section "d: NS kernels + bench_ns" 240 env TRITON_INTERPRET=1 "$PY" scripts/bench_ns.py --device cpu --check \
        --models 8B --scale 64 --batch 2 --repeats 1
fi

# ---- (e) train.py on the GPU ----------------------------------------------------------------------------------
if [ "$MODE" = cuda ]; then TRAIN_STEPS=20; else TRAIN_STEPS=6; fi
train_run() {
    "$PY" train.py --config train_configs/debug_model.toml --training.steps "$TRAIN_STEPS" \
        --checkpoint.enable true --job.dump_folder "$WORK/train" 2>&1 | tee "$WORK/train.log"
    local rc=$?
    echo "---- train.py summary: the device and NS lines, the last steps"
    grep -iE "cuda|nccl|device|NS " "$WORK/train.log" | head -6
    grep -E "step" "$WORK/train.log" | tail -4
    [ "$rc" -eq 0 ] || return "$rc"
    echo "---- generate.py from that checkpoint (bf16 on CUDA, KV cache, two prompts)"
    "$PY" scripts/generate.py "$WORK/train/checkpoint" --prompt "def main(" --prompt "import os" \
        --max-new-tokens 64
}
export PY WORK TRAIN_STEPS
export -f train_run
section "e: train.py debug model, $TRAIN_STEPS steps" 150 bash -c train_run

echo
rm -rf "$WORK"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "gpu_check: done in $((SECONDS - START)) s; every section OK"
    finish 0
fi
echo "gpu_check: done in $((SECONDS - START)) s; FAILED: ${FAILED[*]}"
finish 1
