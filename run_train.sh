#!/usr/bin/env bash
# Launch train.py on this machine with torchrun.
#
#   ./run_train.sh                                     # 1 process, train_configs/debug_model.toml
#   NPROC=4 ./run_train.sh --training.steps 100        # 4 ranks; extra args go to train.py
#   NPROC=8 CONFIG=llama3_8b.toml ./run_train.sh       # a name is looked up in train_configs/
#
# Exit status: train.py's (0 done, 1 diverged or failed, 2 config error, 128 + N stopped by signal N after saving a
# checkpoint). A config error is printed once. SIGTERM, SIGUSR1 and Ctrl-C go to the training processes, which
# stop together at a step boundary and save there (titan_dmuon/parallel/preemption.py); torchrun itself never sees them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-debug_model.toml}"
if [[ ! -f "$CONFIG" && -f "$ROOT/train_configs/$CONFIG" ]]; then
    CONFIG="$ROOT/train_configs/$CONFIG"
fi

# A bad flag, config or path is one line and exit 2 before torchrun starts a rank (titan_dmuon/preflight.py).
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" env -u TITAN_DMUON_STATUS_DIR python -m titan_dmuon.preflight --config "$CONFIG" "$@"

# Each rank writes its exit status (and its one-line message) here and exits 0, so torchrun does not bury it under a
# traceback of its own (titan_dmuon/exit_status.py); a crash still exits non-zero and torchrun reports it.
TITAN_DMUON_STATUS_DIR="$(mktemp -d)"
export TITAN_DMUON_STATUS_DIR
trap 'rm -rf "$TITAN_DMUON_STATUS_DIR"' EXIT

set -m  # torchrun in a process group of its own: a Ctrl-C in this terminal reaches this script only
torchrun --standalone --nproc_per_node "$NPROC" "$ROOT/train.py" --config "$CONFIG" "$@" &
launcher=$!
set +m
forward() {  # to the training processes (torchrun's children), not to torchrun
    pkill "-$1" -P "$launcher" 2>/dev/null || true
}
cd "$ROOT"  # `python -m titan_dmuon...` below, from this checkout
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

rc=0
while true; do
    wait "$launcher" && rc=0 || rc=$?
    kill -0 "$launcher" 2>/dev/null || break  # a trapped signal ends `wait` early: torchrun still runs
done
if [[ "$rc" -ne 0 ]]; then
    exit "$rc"  # a crash: torchrun has reported it
fi
# the largest status the ranks wrote; each distinct message once
python -m titan_dmuon.exit_status collect
