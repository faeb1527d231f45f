#!/usr/bin/env bash
# Chaos run: Fashion-MNIST jobs trained while a random process of the cluster
# (server 0, shard 1 or a worker) is killed with SIGKILL every KILL_EVERY
# seconds, for CHAOS_SECONDS, in every consistency mode. Each killed process
# is started again RESTART_AFTER seconds later with the same arguments (what
# a supervisor or Kubernetes does), server 0 with the same --state-dir.
#
# Per mode it first trains one undisturbed job (the reference), then the
# same job undisturbed with each of NOISE_SEEDS (the noise floor: how far
# the final accuracy of a short run moves when only the seed, and so the
# initial weights and the sample order, changes; a disturbed run trains its
# samples in another order too). Then it submits
# the same job (same seed) again and again while the kills go on, and reports
# for every job: the test accuracy against the reference, the wall time lost
# against the reference, the runs (restarts from a checkpoint), the steps
# lost and the workers lost; then the failures injected, the time lost per
# failure and the duplicate pushes the shards acknowledged without applying
# (exactly-once pushes at work). docs/RELIABILITY.md holds a recorded run.
#
# Cluster: two servers (server 0 = coordinator + shard 0, server 1 = shard 1)
# and two CPU workers (--threads 1) on 127.0.0.1, no TLS (loopback).
#
# Usage: bench/chaos.sh [MODE...]      (default: sync async ssp average)
# Environment (defaults): CHAOS_SECONDS=600 KILL_EVERY=45 RESTART_AFTER=2
#   EPOCHS=3 SEED=1 CHECKPOINT_INTERVAL_S=60 JOB=examples/fashion-mnist.json
#   NOISE_SEEDS="2 3" (undisturbed runs with other seeds; "" for none)
#   PSTRAIN_BENCH_OUT=/tmp/pstrain-chaos PSTRAIN_BIN=build/bin (a copy lets you rebuild meanwhile)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=${PSTRAIN_BIN:-"$ROOT/build/bin"}
MODES=("$@")
((${#MODES[@]})) || MODES=(sync async ssp average)
CHAOS_SECONDS=${CHAOS_SECONDS:-600}
KILL_EVERY=${KILL_EVERY:-45}
RESTART_AFTER=${RESTART_AFTER:-2}
EPOCHS=${EPOCHS:-3}
SEED=${SEED:-1}
CHECKPOINT_INTERVAL_S=${CHECKPOINT_INTERVAL_S:-60}
JOB=${JOB:-examples/fashion-mnist.json}
NOISE_SEEDS=${NOISE_SEEDS-2 3}
OUT=${PSTRAIN_BENCH_OUT:-/tmp/pstrain-chaos}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-1800}  # One job, undisturbed or not.
mkdir -p "$OUT"
for b in pstrain-server pstrain-worker pstrain; do
  [[ -x $BIN/$b ]] || { echo "chaos: $BIN/$b is missing: build first" >&2; exit 2; }
done

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
report() { echo "$*" | tee -a "$OUT/results.txt"; }
now() { date +%s.%N; }

# The cluster: NAMES[i] is started by CMDS[i]; PIDS[i] is its process (or "").
NAMES=(server0 shard1 worker1 worker2)
declare -A CMD PID METRICS
DUPLICATES=0  # Duplicate pushes counted by server processes that were killed.

start() {
  local name=$1 log="$STATE/$1.log"
  echo "=== start $(date -u +%T)" >>"$log"
  # shellcheck disable=SC2086
  ${CMD[$name]} >>"$log" 2>&1 &
  PID[$name]=$!
}
stop_all() {
  local n
  for n in "${NAMES[@]}"; do
    [[ -n ${PID[$n]:-} ]] && kill -TERM "${PID[$n]}" 2>/dev/null || true
  done
  for n in "${NAMES[@]}"; do
    [[ -n ${PID[$n]:-} ]] && wait "${PID[$n]}" 2>/dev/null || true
    PID[$n]=""
  done
}
trap stop_all EXIT

# duplicates NAME: the server's pstrain_server_duplicate_pushes_total (0 if unreadable).
duplicates() {
  local port=${METRICS[$1]:-}
  [[ -z $port ]] && { echo 0; return; }
  curl -s --max-time 2 "http://127.0.0.1:$port/metrics" 2>/dev/null |
    awk '/^pstrain_server_duplicate_pushes_total/ {s += $NF} END {printf "%d\n", s}'
}

start_cluster() {
  stop_all
  STATE=$(mktemp -d "$OUT/cluster.XXXXXX")
  local p0 p1
  p0=$(free_port); p1=$(free_port)
  SERVER="127.0.0.1:$p0"
  METRICS[server0]=$(free_port); METRICS[shard1]=$(free_port)
  local shards="127.0.0.1:$p0,127.0.0.1:$p1"
  CMD[server0]="$BIN/pstrain-server --listen 127.0.0.1:$p0 --shards $shards --shard-index 0 \
    --state-dir $STATE/state0 --metrics-port ${METRICS[server0]} \
    --checkpoint-interval-s $CHECKPOINT_INTERVAL_S"
  CMD[shard1]="$BIN/pstrain-server --listen 127.0.0.1:$p1 --shards $shards --shard-index 1 \
    --state-dir $STATE/state1 --metrics-port ${METRICS[shard1]}"
  CMD[worker1]="$BIN/pstrain-worker --server $SERVER --device cpu --threads 1"
  CMD[worker2]="$BIN/pstrain-worker --server $SERVER --device cpu --threads 1"
  DUPLICATES=0
  local n
  for n in "${NAMES[@]}"; do start "$n"; done
  for _ in $(seq 300); do
    grep -q "registered as" "$STATE/worker1.log" && grep -q "registered as" "$STATE/worker2.log" &&
      break
    sleep 0.1
  done
}

# status JOB -> the job's status as JSON on one line ("" when unreachable).
status() {
  "$BIN/pstrain" --server "$SERVER" --timeout-ms 5000 status "$1" --json 2>/dev/null | tail -1 || true
}
# field STATUS_JSON PATH -> a field of the JobStatus (proto3 JSON: "state" is
# JOB_STATE_..., int64 fields are strings; PATH may go into messages: test.accuracy).
field() {
  python3 -c "
import json, sys
value = json.loads(sys.argv[1])
for key in sys.argv[2].split('.'):
    value = value.get(key, '') if isinstance(value, dict) else ''
print(value)" "$1" "$2" 2>/dev/null
}
# epoch_samples STATUS_JSON -> "60000/60000 60000/60000 ..." (samples trained
# per epoch / the epoch's size, JobStatus.epoch_samples).
epoch_samples() {
  python3 -c "import json,sys; print(' '.join('%s/%s' % (e['samples'], e['expected']) for e in json.loads(sys.argv[1]).get('epoch_samples', [])) or '-')" "$1" 2>/dev/null
}

# job_with_seed SEED -> the path of a copy of $JOB with that seed (its
# model_file made absolute, so that the copy can live in $OUT).
job_with_seed() {
  local path="$OUT/job-seed$1.json"
  python3 - "$ROOT/$JOB" "$1" "$path" <<'PY'
import json, os, sys
src, seed, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
job = json.load(open(src))
job["seed"] = seed
if "model_file" in job:
    job["model_file"] = os.path.join(os.path.dirname(os.path.abspath(src)), job["model_file"])
json.dump(job, open(dst, "w"), indent=1)
PY
  echo "$path"
}

submit() {  # submit MODE [JOB_FILE] -> job id
  local job_file=${2:-$JOB} extra=()
  [[ $1 == average ]] && extra=(--averaging-frequency 5)
  local out
  for _ in $(seq 60); do  # Server 0 may be down for a moment.
    if out=$("$BIN/pstrain" --server "$SERVER" --timeout-ms 10000 submit "$job_file" --workers 2 \
               --mode "$1" --epochs "$EPOCHS" "${extra[@]}" 2>&1); then
      echo "$out" | grep -o 'job-[0-9]*' | head -1
      return
    fi
    sleep 1
  done
  echo "chaos: submit failed: $out" >&2
  exit 1
}

# wait_job JOB DEADLINE_EPOCH_S: sets FINAL to the job's final status JSON
# (state SUCCEEDED/FAILED/CANCELLED, or the last one seen at the deadline).
# While CHAOS is 1, kills a random process every KILL_EVERY seconds. Not
# called in a subshell: the processes it restarts stay this shell's children.
NEXT_KILL=0
FAILURES=0
KILLS_LOG=""
wait_job() {
  local job=$1 deadline=$2 s state
  while true; do
    s=$(status "$job")
    state=$(field "$s" state)
    case $state in JOB_STATE_SUCCEEDED | JOB_STATE_FAILED | JOB_STATE_CANCELLED) FINAL=$s; return ;; esac
    if (($(date +%s) > deadline)); then
      echo "chaos: $job did not end within ${JOB_TIMEOUT_S}s (last status: $s)" >&2
      FINAL=$s
      return
    fi
    if [[ $CHAOS == 1 ]] && (($(date +%s) >= NEXT_KILL)) && (($(date +%s) < CHAOS_END)); then
      local victim=${NAMES[$((RANDOM % ${#NAMES[@]}))]}
      if [[ $victim == server0 || $victim == shard1 ]]; then
        DUPLICATES=$((DUPLICATES + $(duplicates "$victim")))
      fi
      kill -KILL "${PID[$victim]}" 2>/dev/null || true
      wait "${PID[$victim]}" 2>/dev/null || true  # Reaped: the restart can take its port.
      FAILURES=$((FAILURES + 1))
      KILLS_LOG+="$(date -u +%T) $job kill -9 $victim (epoch $(field "$s" epoch), step $(field "$s" step))"$'\n'
      echo "$(date -u +%T) $job: kill -9 $victim" >&2
      sleep "$RESTART_AFTER"
      start "$victim"
      NEXT_KILL=$(($(date +%s) + KILL_EVERY))
    fi
    sleep 1
  done
}

# run_job MODE [JOB_FILE]: submits the job and waits for its end; sets job, s
# (its final status) and wall (seconds from submit to end).
run_job() {
  local t0
  t0=$(now)
  job=$(submit "$@")
  wait_job "$job" $(($(date +%s) + JOB_TIMEOUT_S))
  s=$FINAL
  wall=$(python3 -c "print(round($(now) - $t0, 1))")
}

for mode in "${MODES[@]}"; do
  report "== chaos $mode: $JOB, $EPOCHS epochs, seed $SEED, 2 workers, 2 shards, kill -9 every" \
         "${KILL_EVERY}s for ${CHAOS_SECONDS}s, restart after ${RESTART_AFTER}s," \
         "checkpoint every ${CHECKPOINT_INTERVAL_S}s; $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  # The reference: the same job, undisturbed.
  start_cluster
  CHAOS=0
  run_job "$mode"
  ref_wall=$wall
  ref_acc=$(field "$s" test.accuracy)
  ref_steps=$(field "$s" total_steps)
  report "undisturbed: state $(field "$s" state) test_accuracy $ref_acc wall ${ref_wall}s" \
         "steps $ref_steps samples per epoch $(epoch_samples "$s")"
  [[ $(field "$s" state) == JOB_STATE_SUCCEEDED ]] || { report "the undisturbed run failed: $s"; continue; }
  # The noise floor: the same job undisturbed with other seeds.
  if [[ -n $NOISE_SEEDS ]]; then
    accs=("$ref_acc")
    for seed in $NOISE_SEEDS; do
      run_job "$mode" "$(job_with_seed "$seed")"
      report "undisturbed, seed $seed: state $(field "$s" state) test_accuracy $(field "$s" test.accuracy)" \
             "wall ${wall}s"
      [[ $(field "$s" state) == JOB_STATE_SUCCEEDED ]] && accs+=("$(field "$s" test.accuracy)")
    done
    report "noise floor ($mode, seeds $SEED $NOISE_SEEDS, undisturbed): $(python3 -c "
import statistics, sys
a = [100 * float(x) for x in sys.argv[1:]]
d = [x - a[0] for x in a]
print('accuracy %.2f..%.2f, range %.2f points, stdev %.2f points; seed %s vs the others: %s points' % (
    min(a), max(a), max(a) - min(a), statistics.stdev(a) if len(a) > 1 else 0.0, '$SEED',
    ', '.join('%+.2f' % x for x in d[1:])))" "${accs[@]}")"
  fi

  start_cluster
  CHAOS=1
  FAILURES=0
  KILLS_LOG=""
  CHAOS_END=$(($(date +%s) + CHAOS_SECONDS))
  NEXT_KILL=$(($(date +%s) + KILL_EVERY))
  jobs_run=0 jobs_ok=0 lost_total=0 worst_delta=0 sum_delta=0 steps_lost_total=0
  rm -f "$OUT/kills-$mode.txt"
  # A job is started only while at least one kill can still reach it.
  while (($(date +%s) + KILL_EVERY < CHAOS_END)); do
    run_job "$mode"
    state=$(field "$s" state)
    acc=$(field "$s" test.accuracy)
    delta=""
    jobs_run=$((jobs_run + 1))
    lost=$(python3 -c "print(round(max(0.0, $wall - $ref_wall), 1))")
    lost_total=$(python3 -c "print($lost_total + $lost)")
    if [[ $state == JOB_STATE_SUCCEEDED ]]; then
      jobs_ok=$((jobs_ok + 1))
      delta=$(python3 -c "print(round(100 * (float('$acc') - $ref_acc), 2))")
      sum_delta=$(python3 -c "print($sum_delta + $delta)")
      worst_delta=$(python3 -c "print($delta if abs($delta) > abs($worst_delta) else $worst_delta)")
    fi
    steps_lost=$(field "$s" steps_lost)
    steps_lost_total=$((steps_lost_total + ${steps_lost:-0}))
    report "  $job: state $state test_accuracy ${acc:-?} (${delta:-?} points) wall ${wall}s" \
           "(+${lost}s) runs $(field "$s" runs) steps_lost ${steps_lost:-?}" \
           "workers_lost $(field "$s" workers_lost) samples per epoch $(epoch_samples "$s")$([[ $state != JOB_STATE_SUCCEEDED ]] && echo " reason: $(field "$s" reason)")"
  done
  for n in server0 shard1; do DUPLICATES=$((DUPLICATES + $(duplicates "$n"))); done
  printf '%s' "$KILLS_LOG" >>"$OUT/kills-$mode.txt"
  per_failure=$(python3 -c "print(round($lost_total / max(1, $FAILURES), 1))")
  server_kills=$(grep -c -e server0 -e shard1 "$OUT/kills-$mode.txt" || true)
  # Work lost to restarts from a checkpoint, in seconds of undisturbed training.
  lost_work=$(python3 -c "print(round($steps_lost_total * $ref_wall / max(1, ${ref_steps:-1}) / max(1, $server_kills), 1))")
  mean_delta=$(python3 -c "print(round($sum_delta / max(1, $jobs_ok), 2))")
  report "$mode: $jobs_ok/$jobs_run jobs SUCCEEDED; $FAILURES kill -9 ($(grep -c server0 "$OUT/kills-$mode.txt" || true) server0," \
         "$(grep -c shard1 "$OUT/kills-$mode.txt" || true) shard1, $(grep -c worker "$OUT/kills-$mode.txt" || true) worker);" \
         "accuracy vs undisturbed: mean ${mean_delta}, worst ${worst_delta} points;" \
         "time lost ${lost_total}s = ${per_failure}s per failure; steps retrained $steps_lost_total" \
         "= ${lost_work}s of training per server failure; duplicate pushes acknowledged, not applied: $DUPLICATES"
  stop_all
done
