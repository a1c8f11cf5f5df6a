#!/usr/bin/env bash
# One prepared check of the GPU path on a machine with 1-8 NVIDIA GPUs and no package registry (docs/gpu_check.md).
# Before, on a machine with the registry: `bash scripts/fetch_wheels.sh --python 3.12 --platform
# manylinux_2_28_x86_64` (that machine's Python) fills .whl/, which travels with the checkout. Then, as is:
#
#     bash scripts/gpu_check.sh                            # a GPU machine; the log also goes to $OUT/gpu_check.log
#     GPU_CHECK_ALLOW_CPU=1 bash scripts/gpu_check.sh      # no GPU: every section on CPU/gloo, tiny sizes
#     GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_RANKS=4 bash scripts/gpu_check.sh   # ... on 4 gloo ranks
#     GPU_CHECK_ONLY=compat,moe bash scripts/gpu_check.sh  # only these sections
#     GPU_CHECK_PLANT_FAIL=train bash scripts/gpu_check.sh # that section fails on purpose (the exit must be 1)
#
# Sections, each under its own timeout and inside one time budget (GPU_CHECK_BUDGET_S: 480 s on a GPU, 900 s on a
# CPU); a failing section prints FAIL, the next one runs, and the script exits 1 if ANY failed (or was skipped for
# the budget), 0 only when every section selected passed:
#   env      GPUs, python, torch, triton; installs from .whl/ (pip --no-index: never the registry) what this
#            machine lacks of .whl/requirements.txt (and torch from .whl/torch.txt if it has no torch)
#   compat   every private torch API the code calls, on this torch (scripts/gpu_check_api.py: one list, which
#            tests/unit/framework/test_gpu_check.py holds to a scan of the code), and whether each is guarded
#   parity   (a) the DMuon parity runs of tests/distributed against the single-process torch.optim.Muon reference
#            (python -m tests.gpu_parity N): on CUDA on NCCL under the CUDA sanitizer (TORCH_CUDA_SANITIZER=1),
#            DMuon's side streams slowed (DMUON_DEBUG_SLOW_STREAMS_CYCLES) to widen race windows; on CPU on gloo
#   moe      a bf16 MoE experts step (forward and backward, an expert with no token) through torch._grouped_mm on
#            CUDA, against an fp32 per-expert loop (scripts/gpu_check_moe.py: it says which path ran)
#   memory   the planner's per-rank peak against torch.cuda.max_memory_allocated on real steps of the debug
#            model (scripts/gpu_check_memory.py); on CPU the planned figure only
#   step     (b) scripts/bench_step.py: DMuon vs naive FSDP2 + Muon vs FSDP2 + AdamW ms/step, with a trace
#   overlap  (c) scripts/trace_overlap.py on that trace: DMuon's communication overlapped with compute
#   ns       (d) scripts/bench_ns.py --check: the Triton kernels against float64, the backend, NS time per shape
#   train    (e) train.py, debug model (20 steps on a GPU), then scripts/generate.py from its checkpoint
# At the end: what this machine could not reach (one GPU: every multi-rank NCCL path of DMuon) and the verdict.
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
WHL=${GPU_CHECK_WHEELS:-$ROOT/.whl}
PLANT=${GPU_CHECK_PLANT_FAIL:-}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
START=$SECONDS
FAILED=()
PASSED=()

echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on ${HOSTNAME:-?}, repo $ROOT ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
[ -n "$PLANT" ] && echo "GPU_CHECK_PLANT_FAIL=$PLANT: those sections fail on purpose"

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
    BUDGET=${GPU_CHECK_BUDGET_S:-900}
    echo "no NVIDIA GPU found; GPU_CHECK_ALLOW_CPU=1: every section on CPU/gloo with tiny sizes, $N rank(s)"
else
    MODE=cuda
    N=${GPU_CHECK_RANKS:-$NGPU}
    [ "$N" -gt 8 ] && N=8
    BUDGET=${GPU_CHECK_BUDGET_S:-480}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PY WORK WHL MODE N ROOT

# section KEY TITLE TIMEOUT_S CMD...: runs CMD under min(TIMEOUT_S, what is left of the budget); OK or FAIL.
# GPU_CHECK_ONLY selects sections by KEY (or the old letters a-e); GPU_CHECK_PLANT_FAIL=KEY[,KEY] runs CMD with
# GPU_CHECK_PLANTED=1, which each section's command turns into a failure of its own (the python checks fail at
# their end, train.py gets a bad flag inside its pipe); a command that does not know it is failed after it ran.
selected() {
    [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
    local letter=""
    case "$1" in
    parity) letter=a ;; step) letter=b ;; overlap) letter=c ;; ns) letter=d ;; train) letter=e ;;
    esac
    [[ ",$GPU_CHECK_ONLY," == *",$1,"* ]] || { [ -n "$letter" ] && [[ ",$GPU_CHECK_ONLY," == *",$letter,"* ]]; }
}
section() {
    local key=$1 title=$2 limit=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START)))
    echo
    if ! selected "$key"; then
        echo "==== [$key] $title: not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
        return
    fi
    if [ "$left" -lt 15 ]; then
        echo "==== [$key] $title: SKIP, out of the time budget (${BUDGET} s): counts as a failure"
        FAILED+=("$key(out of budget)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local planted=()
    [[ ",$PLANT," == *",$key,"* ]] && planted=(GPU_CHECK_PLANTED=1)
    echo "==== [$key] $title (timeout ${limit} s)${planted:+ [planted failure]}"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" env "${planted[@]}" "$@"
    rc=$?
    if [ "$rc" -eq 0 ] && [ ${#planted[@]} -gt 0 ]; then
        echo "planted failure: the command passed, the section is failed after it (GPU_CHECK_PLANT_FAIL=$key)"
        rc=97
    fi
    if [ "$rc" -eq 0 ]; then
        echo "==== [$key] OK ($((SECONDS - t0)) s)"
        PASSED+=("$key")
    else
        local why=""
        [ "$rc" -eq 124 ] && why=", timed out"
        echo "==== [$key] FAIL (exit $rc$why, $((SECONDS - t0)) s)"
        FAILED+=("$key")
    fi
}

# ---- env: the packages this machine lacks come from .whl/ (never from a registry) ----------------------------
env_section() {
    # pip reads no configuration (its indexes and find-links) and no PIP_* variable: .whl/ alone
    local pip=(env -u PYTHONPATH -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT
        -u PIP_REQUIREMENT PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip)
    local ok=0
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        if [ -f "$WHL/torch.txt" ]; then
            echo "no torch here: installing $(cat "$WHL/torch.txt") from $WHL"
            "${pip[@]}" install -q --no-index --find-links "$WHL" -r "$WHL/torch.txt" || ok=1
        else
            echo "FAIL: this Python has no torch, and $WHL has no torch.txt (scripts/fetch_wheels.sh --with-torch)"
            ok=1
        fi
    fi
    if [ -f "$WHL/requirements.txt" ]; then
        echo "installing from $WHL (pip --no-index) what this machine lacks of: $(tr '\n' ' ' <"$WHL/requirements.txt")"
        if ! "${pip[@]}" install -q --no-index --find-links "$WHL" -r "$WHL/requirements.txt"; then
            # an externally managed Python (PEP 668) takes no install: every wheel but torch's and the project's
            # into a folder of their own, put on PYTHONPATH for the sections after this one
            local site=$WORK/site wheels=()
            for w in "$WHL"/*.whl; do
                case "$(basename "$w")" in torch-* | titan_dmuon-*) ;; *) wheels+=("$w") ;; esac
            done
            echo "that install failed; retrying into $site (on PYTHONPATH for the next sections)"
            if [ ${#wheels[@]} -gt 0 ] &&
                "${pip[@]}" install -q --no-index --no-deps --target "$site" "${wheels[@]}"; then
                echo "$site" >"$WORK/site_path"
                export PYTHONPATH=$PYTHONPATH:$site
            else
                echo "FAIL: pip install --no-index --find-links $WHL failed (wheels for another Python? rerun" \
                    "scripts/fetch_wheels.sh --python X.Y --platform ... for this machine)"
                ok=1
            fi
        fi
    else
        echo "no $WHL/requirements.txt: nothing installed (scripts/fetch_wheels.sh makes it)"
    fi
    "$PY" - <<'EOF' || ok=1
import importlib
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
missing = []
for name in ("tyro", "torchdata", "tensorboard", "numpy", "tokenizers", "safetensors", "tqdm", "huggingface_hub"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    print(f"FAIL: missing after the install: {', '.join(missing)}")
    raise SystemExit(1)
print("the project's dependencies import")
EOF
    if [ -n "${GPU_CHECK_PLANTED:-}" ]; then
        echo "FAIL: planted failure (GPU_CHECK_PLANTED)"
        ok=1
    fi
    return $ok
}
export -f env_section
section env "environment, wheels from .whl/" 300 bash -c env_section
if [ -f "$WORK/site_path" ]; then
    PYTHONPATH=$PYTHONPATH:$(cat "$WORK/site_path")
    export PYTHONPATH
fi
echo "mode $MODE, $N rank(s); time budget ${BUDGET} s for the sections; scratch $WORK"

# ---- compat: every private torch API the code calls ------------------------------------------------------------
section compat "the private torch APIs the code calls" 90 "$PY" scripts/gpu_check_api.py

# ---- (a) parity: on NCCL under the CUDA sanitizer, side streams slowed (gloo on CPU) -------------------------
SLOW_CYCLES=${GPU_CHECK_SLOW_STREAMS_CYCLES:-2000000} # ~1 ms at 2 GHz per entry of a side stream
# torch's sanitizer (2.13 and before) sees a collective as a kernel of the stream it was issued from, not of
# NCCL's internal stream: with >= 2 GPUs a report that names a c10d op may be that model, not a race (a later torch
# traces the NCCL stream). GPU_CHECK_SANITIZER=0 runs the same parity without it, to tell the two apart.
if [ "$MODE" = cuda ] && [ "${GPU_CHECK_SANITIZER:-1}" = 1 ]; then
    section parity "parity on NCCL under the CUDA sanitizer" $((180 + 30 * N)) env TITAN_DMUON_TEST_BACKEND=nccl \
        TORCH_CUDA_SANITIZER=1 DMUON_DEBUG_SLOW_STREAMS_CYCLES="$SLOW_CYCLES" "$PY" -m tests.gpu_parity "$N"
elif [ "$MODE" = cuda ]; then
    section parity "parity on NCCL (GPU_CHECK_SANITIZER=0: no sanitizer)" $((150 + 20 * N)) env \
        TITAN_DMUON_TEST_BACKEND=nccl DMUON_DEBUG_SLOW_STREAMS_CYCLES="$SLOW_CYCLES" "$PY" -m tests.gpu_parity "$N"
else
    section parity "parity on gloo (CPU: no sanitizer, no streams)" 300 \
        env TITAN_DMUON_TEST_BACKEND=gloo "$PY" -m tests.gpu_parity "$N"
fi

# ---- moe: bf16 experts through torch._grouped_mm, forward and backward, an expert with no token ---------------
section moe "bf16 MoE step through torch._grouped_mm" 90 "$PY" scripts/gpu_check_moe.py --device "$MODE"

# ---- memory: the planner's peak against torch.cuda.max_memory_allocated -----------------------------------------
section memory "planned peak vs torch.cuda.max_memory_allocated" 150 "$PY" scripts/gpu_check_memory.py --steps 3

# ---- (b) step time, with a trace; (c) the overlap in that trace ----------------------------------------------
if [ "$MODE" = cuda ]; then
    STEP_ARGS=(--device cuda --nproc "$N" --d 2048 --ff 8192 --layers 4 --batch 4096 --steps 10 --warmup 3)
else
    STEP_ARGS=(--device cpu --nproc "$N" --d 64 --ff 128 --layers 2 --batch 8 --steps 3 --warmup 1)
fi
section step "DMuon vs FSDP2+AdamW step time" 120 "$PY" scripts/bench_step.py "${STEP_ARGS[@]}" --trace "$WORK/trace"
if [ "$N" -eq 1 ]; then
    echo "note: world size 1: DMuon's broadcasts and reduces span one rank, so there is no real communication to"
    echo "      overlap; the overlap figure needs >= 2 GPUs (the trace still shows the step's kernels)"
fi
section overlap "communication overlapped with compute" 60 \
    bash -c "$PY scripts/trace_overlap.py --world-size $N $WORK/trace/dmuon_rank*.json"
if [ -n "${OUT:-}" ] && [ -f "$WORK/trace/dmuon_rank0.json" ]; then
    gzip -c "$WORK/trace/dmuon_rank0.json" >"$OUT/dmuon_rank0_trace.json.gz" &&
        echo "trace of rank 0 kept as $OUT/dmuon_rank0_trace.json.gz"
fi

# ---- (d) Newton-Schulz: the Triton kernels on the GPU, the backend, time per shape --------------------------
if [ "$MODE" = cuda ]; then
    section ns "NS kernels + bench_ns" 170 "$PY" scripts/bench_ns.py --check --models 8B 70B --batch 4 --repeats 2
else
    section ns "NS kernels + bench_ns" 240 env TRITON_INTERPRET=1 "$PY" scripts/bench_ns.py --device cpu --check \
        --models 8B --scale 64 --batch 2 --repeats 1
fi

# ---- (e) train.py, then generate.py from its checkpoint ----------------------------------------------------------
if [ "$MODE" = cuda ]; then TRAIN_STEPS=20; else TRAIN_STEPS=6; fi
train_section() {
    set -o pipefail # each pipe's status is its first failing command's (not tee's)
    local planted=()
    [ -n "${GPU_CHECK_PLANTED:-}" ] && planted=(--training.gpu_check_planted_failure 1) # a config error: exit 2
    "$PY" train.py --config train_configs/debug_model.toml --training.steps "$TRAIN_STEPS" \
        --checkpoint.enable true --job.dump_folder "$WORK/train" "${planted[@]}" 2>&1 | tee "$WORK/train.log"
    local rc=${PIPESTATUS[0]}
    echo "---- train.py exited $rc; the device and NS lines, the last steps"
    grep -iE "cuda|nccl|device|NS " "$WORK/train.log" | head -6
    grep -E "step" "$WORK/train.log" | tail -4
    [ "$rc" -eq 0 ] || return "$rc"
    echo "---- generate.py from that checkpoint (bf16 on CUDA, KV cache, two prompts)"
    "$PY" scripts/generate.py "$WORK/train/checkpoint" --prompt "def main(" --prompt "import os" \
        --max-new-tokens 64
}
export TRAIN_STEPS
export -f train_section
section train "train.py debug model, $TRAIN_STEPS steps, then generate.py" 240 bash -c train_section

# ---- what this machine could not reach ------------------------------------------------------------------------
echo
echo "==== not reached on this machine"
if [ "$MODE" = cpu ]; then
    echo "  - no GPU: the CUDA sanitizer, DMuon's CUDA streams (and their debug delay), NCCL, the CUDA"
    echo "    torch._grouped_mm kernels, torch.cuda.max_memory_allocated and the Triton kernels on a GPU (the NS"
    echo "    check ran under TRITON_INTERPRET=1): every CUDA figure above stays unmeasured"
fi
if [ "$N" -lt 2 ]; then
    echo "  - one rank: every multi-rank NCCL path of DMuon. A 1-rank mesh makes no DMuon process group"
    echo "    (comm.dedicated_group returns None for one rank) and every coalesced broadcast / reduce returns"
    echo "    before issuing (comm._rooted_coalesced: size 1): the shard-axis broadcasts and reduces, the"
    echo "    replicate-axis publish (async and sync), the high/default-priority NCCL groups, the TP gather and"
    echo "    scatter, and the expert-parallel all-to-all stay unmeasured, and so does the overlap of any of"
    echo "    them with compute; the DDP, TP and HSDP parity runs were skipped. One GPU cannot host two NCCL ranks"
    echo "    (\"Duplicate GPU detected\"): these need a machine with >= 2 GPUs (>= 4 for HSDP), where the parity"
    echo "    section runs them on NCCL under the sanitizer."
elif [ "$N" -lt 4 ]; then
    echo "  - fewer than 4 ranks: the HSDP (replicate x shard) parity run and its async publish"
fi
[ "$MODE" = cuda ] && [ "$N" -ge 4 ] && echo "  - nothing the sections name: every DMuon path ran on NCCL"

echo
rm -rf "$WORK"
echo "gpu_check: sections OK: ${PASSED[*]:-none}"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "gpu_check: done in $((SECONDS - START)) s; every section OK"
    finish 0
fi
echo "gpu_check: done in $((SECONDS - START)) s; FAILED: ${FAILED[*]}"
finish 1
