#!/usr/bin/env bash
# Fashion-MNIST acceptance runs of the distributed service on this machine,
# each beside the standalone engine measured in the same session:
#   1. accuracy: examples/fashion-mnist.json (10 epochs) with one server and two
#      CPU workers in sync, async and average (K=5) modes, and standalone with
#      batch 128 (= the sync run's global batch, 2 x 64) for the comparison;
#   3. compression: the same job in sync mode with two workers for
#      PSTRAIN_EPOCHS (default 3) epochs under each gradient codec (none, fp16,
#      bf16, topk 1%, onebit; same seed), with the final test accuracy, the
#      wall time, and the push bytes the server received per worker step
#      beside the F32 bytes they represent (its /metrics counters).
#      PSTRAIN_JOB picks another job file (bench/jobs/fmnist-chaos.json: the
#      schedule annealed over 3 epochs, a seed-to-seed spread of 0.07 points
#      instead of 0.49) and PSTRAIN_CODECS the codecs (the first is the base;
#      topk:0.01@262144 adds --min-compress-bytes 262144, and /CODEC a
#      --pull-compression: fp16/fp16, onebit@262144/onebit).
#   2. time to 0.90 test accuracy: constant learning rate (no schedule), epochs
#      E = 1, 2, ... until the test accuracy reaches 0.90, standalone (batch 64)
#      and two workers (sync, 2 x 64); the figure is the wall time of the first
#      run that reached it.
# Usage: bench/fmnist_distributed.sh [accuracy|tta|compression|all]   (build/ must exist)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN="$ROOT/build/bin"
WHAT=${1:-all}
OUT=${PSTRAIN_BENCH_OUT:-/tmp/pstrain-fmnist-distributed}
mkdir -p "$OUT"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
# json_field PATH < the CLI's output -> a field of its last line, a JobStatus
# in proto3 JSON (PATH may go into messages: test.accuracy).
json_field() {
  python3 -c "
import functools, json, sys
status = json.loads(sys.stdin.read().strip().splitlines()[-1])
print(functools.reduce(lambda value, key: value[key], sys.argv[1].split('.'), status))" "$1"
}

PIDS=()
stop_cluster() {
  if ((${#PIDS[@]})); then kill -TERM "${PIDS[@]}" 2>/dev/null || true; wait "${PIDS[@]}" 2>/dev/null || true; fi
  PIDS=()
}
trap stop_cluster EXIT
start_cluster() {
  stop_cluster
  PORT=$(free_port)
  STATE=$(mktemp -d "$OUT/state.XXXXXX")
  METRICS_PORT=$(free_port)
  "$BIN/pstrain-server" --listen "127.0.0.1:$PORT" --state-dir "$STATE" \
    --metrics-port "$METRICS_PORT" >"$STATE/server.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 300); do grep -q "listening on" "$STATE/server.log" && break; sleep 0.1; done
  for w in 1 2; do
    "$BIN/pstrain-worker" --server "127.0.0.1:$PORT" --device cpu --threads 1 >"$STATE/worker$w.log" 2>&1 &
    PIDS+=($!)
  done
  for w in 1 2; do for _ in $(seq 300); do grep -q "registered" "$STATE/worker$w.log" && break; sleep 0.1; done; done
}

# distributed JOB MODE EPOCHS [extra submit args] -> "accuracy seconds"
distributed() {
  local job=$1 mode=$2 epochs=$3; shift 3
  start_cluster
  local t0 t1 out
  t0=$(date +%s.%N)
  out=$("$BIN/pstrain" --server "127.0.0.1:$PORT" --timeout-ms 30000 submit "$job" --workers 2 \
        --mode "$mode" --epochs "$epochs" --watch --json "$@" 2>&1 | tail -1)
  t1=$(date +%s.%N)
  stop_cluster
  echo "$(echo "$out" | json_field test.accuracy) $(python3 -c "print(round($t1-$t0,1))")"
}

# The value of an unlabelled counter on the server's /metrics.
metric() { curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | awk -v n="$1" '$1 == n {print $2}'; }

# compressed JOB EPOCHS CODEC -> "accuracy seconds steps received_bytes represented_bytes
#   pull_sent_bytes pull_represented_bytes"
# CODEC is a --compression value, optionally @BYTES for --min-compress-bytes
# (without it, topk and onebit send parameters under 256 KiB whole, the
# coordinator's default; topk:0.01@0 compresses every parameter), optionally /PULL for
# --pull-compression (onebit@262144/onebit: 1-bit both ways, small
# parameters whole both ways).
compressed() {
  local job=$1 epochs=$2 codec=$3
  local push=${codec%%/*} extra=()
  [[ $codec == */* ]] && extra+=(--pull-compression "${codec#*/}")
  [[ $push == *@* ]] && extra+=(--min-compress-bytes "${push#*@}")
  start_cluster
  local t0 t1 out
  t0=$(date +%s.%N)
  out=$("$BIN/pstrain" --server "127.0.0.1:$PORT" --timeout-ms 30000 submit "$job" --workers 2 \
        --mode sync --epochs "$epochs" --compression "${push%@*}" "${extra[@]}" --watch --json 2>&1 | tail -1)
  t1=$(date +%s.%N)
  sleep 1.5  # The counters refresh every second.
  local received represented pulled pull_represented
  received=$(metric pstrain_server_push_bytes_total)
  represented=$(metric pstrain_server_push_represented_bytes_total)
  pulled=$(metric pstrain_server_pull_bytes_total)
  pull_represented=$(metric pstrain_server_pull_represented_bytes_total)
  stop_cluster
  echo "$(echo "$out" | json_field test.accuracy) $(python3 -c "print(round($t1-$t0,1))") \
$(echo "$out" | json_field step) $received $represented $pulled $pull_represented"
}

# standalone JOB EPOCHS BATCH -> "accuracy seconds"
standalone() {
  local t0 t1 out
  t0=$(date +%s.%N)
  out=$("$BIN/pstrain-worker" --standalone "$1" --device cpu --epochs "$2" --batch "$3" --checkpoint none)
  t1=$(date +%s.%N)
  echo "$(echo "$out" | json_field test.accuracy) $(python3 -c "print(round($t1-$t0,1))")"
}

report() { echo "$*" | tee -a "$OUT/results.txt"; }

if [[ $WHAT == accuracy || $WHAT == all ]]; then
  JOB=examples/fashion-mnist.json
  report "== accuracy, $JOB, 10 epochs, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  report "sync 2 workers (2x64):        $(distributed $JOB sync 10)   (test_accuracy seconds)"
  report "standalone batch 128:         $(standalone $JOB 10 128)"
  report "async 2 workers:              $(distributed $JOB async 10)"
  report "average K=5 2 workers:        $(distributed $JOB average 10 --averaging-frequency 5)"
fi

if [[ $WHAT == compression || $WHAT == all ]]; then
  JOB=${PSTRAIN_JOB:-examples/fashion-mnist.json}
  EPOCHS=${PSTRAIN_EPOCHS:-3}
  report "== compression, $JOB, sync, 2 workers (2x64), $EPOCHS epochs, seed of the job, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg), $(lscpu | sed -n 's/^Model name: *//p')"
  report "codec     test_accuracy  vs_none(points)  seconds  push_bytes_per_worker_step  fp32_bytes_per_worker_step  ratio  pull_bytes_per_worker_step  pull_ratio"
  base=""
  for codec in ${PSTRAIN_CODECS:-none fp16 bf16 topk:0.01 topk:0.01@0 onebit onebit@0}; do
    read -r acc secs steps received represented pulled pull_represented <<<"$(compressed $JOB "$EPOCHS" $codec)"
    [[ -z $base ]] && base=$acc
    report "$(python3 -c "
acc, base, secs, steps, rec, rep = $acc, $base, $secs, $steps, float('$received'), float('$represented')
pulled, pull_rep = float('$pulled'), float('$pull_represented')
per = rec / (2 * steps); full = rep / (2 * steps); pull = pulled / (2 * steps)
print(f'{\"$codec\":<9} {acc:<14.4f} {100 * (acc - base):<+16.2f} {secs:<8} {per:<27.0f} {full:<27.0f} {full / per:.1f}x  {pull:<27.0f} {pull_rep / pulled:.1f}x')")"
  done
fi

if [[ $WHAT == tta || $WHAT == all ]]; then
  TTA_JOB="$OUT/fmnist-constant-lr.json"
  python3 - "$ROOT/examples/fashion-mnist.json" "$TTA_JOB" <<'PY'
import json, os, sys
job = json.load(open(sys.argv[1]))
job["optimizer"].pop("schedule", None)
job["model_file"] = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), job["model_file"])
json.dump(job, open(sys.argv[2], "w"), indent=1)
PY
  report "== time to 0.90 test accuracy, constant lr 0.01 momentum 0.9, $(date -u +%FT%TZ)"
  for e in 1 2 3 4 5 6 7 8; do
    r=$(standalone "$TTA_JOB" $e 64); report "standalone b64 epochs $e: $r"
    awk -v a="${r% *}" 'BEGIN{exit !(a >= 0.90)}' && break
  done
  for e in 1 2 3 4 5 6 7 8; do
    r=$(distributed "$TTA_JOB" sync $e); report "sync 2 workers epochs $e: $r"
    awk -v a="${r% *}" 'BEGIN{exit !(a >= 0.90)}' && break
  done
fi
