#!/usr/bin/env bash
# Launch train.py on this machine with torchrun.
#
#   ./run_train.sh                                     # 1 process, train_configs/debug_model.toml
#   NPROC=4 ./run_train.sh --training.steps 100        # 4 ranks; extra args go to train.py
#   NPROC=8 CONFIG=llama3_8b.toml ./run_train.sh       # a name is looked up in train_configs/
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-debug_model.toml}"
if [[ ! -f "$CONFIG" && -f "$ROOT/train_configs/$CONFIG" ]]; then
    CONFIG="$ROOT/train_configs/$CONFIG"
fi

exec torchrun --standalone --nproc_per_node "$NPROC" "$ROOT/train.py" --config "$CONFIG" "$@"
