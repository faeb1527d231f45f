#!/bin/bash
# Interleaved A/B of pstrain-worker builds on CPU training: every round runs
# each binary once on the same standalone job (fmnist-cnn, batch 64, the
# first SAMPLES training images), so machine noise hits all of them alike;
# the median samples/s of each binary is printed with every round's figure.
#
#   bench/worker_ab.sh [--rounds N] [--samples N] BINARY [BINARY...]
#
# Measures a change before and after: build the old worker, copy it aside,
# build the new one, and pass both.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
rounds=8
samples=6400
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --samples) samples="$2"; shift 2 ;;
    -*) echo "usage: $0 [--rounds N] [--samples N] BINARY [BINARY...]" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--rounds N] [--samples N] BINARY [BINARY...]" >&2
  exit 2
fi
declare -A results
for ((r = 1; r <= rounds; r++)); do
  for binary in "$@"; do
    line=$("$binary" --standalone "$ROOT/bench/jobs/fmnist-cnn-bench.json" --device cpu \
      --limit "$samples" --batch 64 --checkpoint none 2>/dev/null | tail -1)
    value=$(sed -n 's/.*"train_samples_per_sec": \([0-9.]*\).*/\1/p' <<<"$line")
    [[ -n "$value" ]] || { echo "$binary: no train_samples_per_sec in: $line" >&2; exit 1; }
    results[$binary]+=" $value"
    echo "round $r: $binary $value samples/s"
  done
done
echo "median samples/s over $rounds rounds of $samples samples:"
for binary in "$@"; do
  median=$(tr ' ' '\n' <<<"${results[$binary]}" | sed '/^$/d' | sort -n |
    awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}')
  echo "  $binary $median"
done
