#!/usr/bin/env bash
# Does a DMuon script over gloo that ends with dist.destroy_process_group() exit 0 every time, also under CPU load?
# Runs scripts/seed_exit.py (2 ranks, torchrun) N times per path with two busy loops beside it and counts the exit
# codes; a run whose log says "terminate called" is named.
#
#   scripts/exit_stress.sh 20            # ddp and fsdp2, 20 runs each
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-20}"
logs=$(mktemp -d)
( while true; do :; done ) & hog1=$!
( while true; do :; done ) & hog2=$!
trap 'kill $hog1 $hog2 2>/dev/null; rm -rf "$logs"' EXIT
for path in ddp fsdp2; do
  declare -A codes=()
  for i in $(seq "$n"); do
    OMP_NUM_THREADS=1 timeout 120 torchrun --standalone --nproc_per_node 2 scripts/seed_exit.py "$path" \
      >"$logs/$path-$i.log" 2>&1
    rc=$?
    codes[$rc]=$((${codes[$rc]:-0} + 1))
    grep -q "terminate called" "$logs/$path-$i.log" && echo "$path run $i: terminate called (exit $rc)"
  done
  for k in "${!codes[@]}"; do echo "$path: exit $k in ${codes[$k]} of $n runs"; done
  unset codes
done
