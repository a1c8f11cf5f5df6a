#!/usr/bin/env bash
# What the README's install steps cost: for each git revision and each extras spec, a brand-new virtual environment
# with the pinned torch, then `pip install -c requirements/constraints.txt -e .<extras>` from that revision's
# checkout; prints the project install's seconds, the packages it added to torch's and the environment's size.
#
#   scripts/bench_install.sh                         # HEAD: "" (train) and "[test]"
#   scripts/bench_install.sh b233d7d:[dev] HEAD: HEAD:[test]   # REV:EXTRAS pairs, side by side in one run
set -euo pipefail
cd "$(dirname "$0")/.."
specs=("$@")
[[ ${#specs[@]} -gt 0 ]] || specs=("HEAD:" "HEAD:[test]")
tmp=$(mktemp -d)
trap 'for w in "$tmp"/src-*; do git worktree remove --force "$w" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT

for spec in "${specs[@]}"; do
  rev=${spec%%:*} extras=${spec#*:}
  src="$tmp/src-$(git rev-parse --short "$rev")"
  [[ -d "$src" ]] || git worktree add -q --detach "$src" "$rev"
  venv="$tmp/venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q torch==2.13.0 2>/dev/null
  before=$("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l)
  start=$(date +%s.%N)
  (cd "$src" && "$venv/bin/python" -m pip install -q -c requirements/constraints.txt -e ".$extras" 2>/dev/null)
  end=$(date +%s.%N)
  after=$("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l)
  printf '%s .%s: install %.1f s, %d packages added to torch'"'"'s %d, environment %s MB\n' "$rev" "$extras" \
    "$(python3 -c "print($end - $start)")" $((after - before)) "$before" "$(du -sm "$venv" | cut -f1)"
done
