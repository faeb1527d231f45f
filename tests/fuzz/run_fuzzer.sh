#!/usr/bin/env bash
# One bounded libFuzzer run: RUNS inputs (at most SECONDS) mutated from the
# seed corpus. New inputs go to WORK/corpus (never into the source tree);
# a crash, leak, sanitizer report or timeout fails the run, and its input is
# kept as WORK/crash-* with the command that replays it.
# Usage: run_fuzzer.sh FUZZER SEED_DIR WORK RUNS SECONDS
set -euo pipefail
FUZZER=$1 SEEDS=$2 WORK=$3 RUNS=$4 SECONDS_MAX=$5
mkdir -p "$WORK/corpus"
set +e
"$FUZZER" -runs="$RUNS" -max_total_time="$SECONDS_MAX" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$WORK/" "$WORK/corpus" "$SEEDS" \
  >"$WORK/log" 2>&1
rc=$?
set -e
grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|Done|INFO: Seed)" "$WORK/log" || true
if [[ $rc -ne 0 ]]; then
  tail -60 "$WORK/log"
  echo "FAIL: $(basename "$FUZZER") exit $rc; replay: $FUZZER $WORK/crash-* (or oom-/timeout-)"
  exit 1
fi
echo "PASS: $(basename "$FUZZER")"
