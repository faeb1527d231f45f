#!/usr/bin/env bash
# `pstrain-worker --standalone JOB --metrics-port P` serves /metrics while it
# trains, with the per-GPU gauges (what bench/gpu_session.sh samples for the
# GPU-busy figure): pstrain_worker_gpu_available, and on a GPU machine one
# pstrain_worker_gpu_utilization_ratio per GPU. The listen policy holds there
# too: a non-loopback --metrics-host without TLS or --insecure is refused.
#
#   standalone_metrics_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
JOB=$SRC/examples/fashion-mnist.json
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -d /usr/share/datasets/fashion-mnist ]] || fail "dataset-fashion-mnist is not installed"
WORK=$(mktemp -d)
pid=""
trap '[[ -n $pid ]] && kill "$pid" 2>/dev/null; rm -rf "$WORK"' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
fetch() {
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=2).read().decode())"
}

echo "== /metrics while a standalone run trains"
"$BIN/pstrain-worker" --standalone "$JOB" --device auto --threads 1 --epochs 8 --limit 2048 \
  --checkpoint none --metrics-port "$PORT" >"$WORK/run.log" 2>&1 &
pid=$!
scraped=0
for _ in $(seq 300); do
  if fetch >"$WORK/metrics.txt" 2>/dev/null && grep -q '^pstrain_worker_gpu_available ' "$WORK/metrics.txt"; then
    scraped=1
    break
  fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
((scraped)) || { cat "$WORK/run.log"; fail "no /metrics with the GPU gauges on port $PORT while training"; }
grep '^pstrain_worker_gpu' "$WORK/metrics.txt"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  grep -q '^pstrain_worker_gpu_available 1' "$WORK/metrics.txt" || fail "a GPU is present but not reported"
  sleep 1.5  # The gauges refresh every second.
  fetch | grep -q '^pstrain_worker_gpu_utilization_ratio{' || fail "no utilization series on a GPU machine"
else
  grep -q '^pstrain_worker_gpu_available 0' "$WORK/metrics.txt" || fail "no GPU here, but one is reported"
fi
wait "$pid" || { cat "$WORK/run.log"; fail "the standalone run failed"; }
pid=""
tail -1 "$WORK/run.log" | grep -q '"test_accuracy"' || { cat "$WORK/run.log"; fail "no result line"; }
grep -q "metrics on http://127.0.0.1:$PORT/metrics" "$WORK/run.log" || fail "the address is not printed"
echo ok

echo "== a non-loopback --metrics-host without TLS is refused"
if "$BIN/pstrain-worker" --standalone "$JOB" --device cpu --epochs 1 --limit 256 --checkpoint none \
     --metrics-port "$PORT" --metrics-host 0.0.0.0 >"$WORK/refused.log" 2>&1; then
  cat "$WORK/refused.log"
  fail "a plain-HTTP /metrics on 0.0.0.0 was served"
fi
cat "$WORK/refused.log"
grep -q -- "--metrics-host" "$WORK/refused.log" || fail "the refusal does not name --metrics-host"
grep -q '"test_accuracy"' "$WORK/refused.log" && fail "it trained before refusing"
echo ok
