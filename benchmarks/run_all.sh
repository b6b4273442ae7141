#!/usr/bin/env bash
# Runs every registered benchmark and keeps each one's JSON line under runs/bench/<name>.json.
# Usage: bash benchmarks/run_all.sh [NAME ...]   (default: all of `tailspec bench --help`)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <($BIN/python -c "from tailspec.benchmarks import BENCHES; print('\n'.join(BENCHES))")
fi
mkdir -p runs/bench
for n in "${names[@]}"; do
  echo "== tailspec bench $n --json"
  $BIN/tailspec bench "$n" --json | tee "runs/bench/$n.log"
  tail -n 1 "runs/bench/$n.log" > "runs/bench/$n.json"
done
