#!/usr/bin/env bash
# Prometheus end to end: a real pstrain-server and two pstrain-workers on
# 127.0.0.1 train a small Fashion-MNIST job while a real Prometheus (Debian's
# `prometheus`) scrapes all three every second, the way a cluster runs: TLS,
# mTLS and tokens on gRPC (deploy/local/make-certs.sh) and /metrics over
# HTTPS, which Prometheus verifies against the cluster's CA and reaches with
# its own client certificate (every daemon runs --require-client-cert).
# Checks:
#  1. the /metrics text of the server and of a worker passes
#     `promtool check metrics` (lint problems fail the test), and neither
#     answers a scraper without a client certificate;
#  2. through Prometheus's HTTP API (/api/v1/query), samples/s, the model
#     version and the push latency exist for every target that has them and
#     change while the job trains; the worker says whether it has a GPU.
#
# Usage: prometheus_test.sh BIN_DIR SOURCE_DIR
# Prometheus can always be installed here (deploy/local/install-deps.sh with
# PSTRAIN_TEST_TOOLS=1), so a missing one fails rather than skips.
set -euo pipefail
BIN=$1
SRC=$2
for tool in prometheus promtool curl python3; do
  command -v "$tool" >/dev/null || {
    echo "FAIL: $tool is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
    exit 1
  }
done
[[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]] || {
  echo "FAIL: dataset-fashion-mnist is not installed"; exit 1; }

WORK=$(mktemp -d /tmp/pstrain-prometheus-test.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ "${KEEP:-0}" != 1 ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
wait_for() {  # FILE PATTERN SECONDS
  for _ in $(seq $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "FAIL: timed out waiting for '$2' in $1:"; tail -20 "$1"; exit 1
}

PORT=$(free_port); SM=$(free_port); W1=$(free_port); W2=$(free_port); PP=$(free_port)
SERVER=127.0.0.1:$PORT
CERTS=$WORK/certs
"$SRC/deploy/local/make-certs.sh" "$CERTS" >/dev/null
export PSTRAIN_TLS_CA=$CERTS/ca.pem PSTRAIN_TLS_CERT=$CERTS/admin.pem \
  PSTRAIN_TLS_KEY=$CERTS/admin-key.pem PSTRAIN_TOKEN_FILE=$CERTS/admin.token
"$BIN/pstrain-server" --listen "$SERVER" --metrics-port "$SM" --state-dir "$WORK/state" \
  --heartbeat-interval-ms 500 --tls-cert "$CERTS/server.pem" --tls-key "$CERTS/server-key.pem" \
  --tls-ca "$CERTS/ca.pem" --require-client-cert --token-file "$CERTS/tokens" \
  >"$WORK/server.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/server.log" "listening on" 60
for w in 1 2; do
  mport=$W1; [[ $w == 2 ]] && mport=$W2
  "$BIN/pstrain-worker" --server "$SERVER" --metrics-port "$mport" --device cpu --threads 1 \
    --tls-ca "$CERTS/ca.pem" --tls-cert "$CERTS/worker.pem" --tls-key "$CERTS/worker-key.pem" \
    --require-client-cert --token-file "$CERTS/worker.token" >"$WORK/worker$w.log" 2>&1 &
  PIDS+=($!)
done
wait_for "$WORK/worker1.log" "registered" 60
wait_for "$WORK/worker2.log" "registered" 60

cat >"$WORK/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: pstrain-server
    scheme: https
    tls_config: {ca_file: "$CERTS/ca.pem", cert_file: "$CERTS/prometheus.pem",
                 key_file: "$CERTS/prometheus-key.pem"}
    static_configs: [{targets: ["127.0.0.1:$SM"]}]
  - job_name: pstrain-worker
    scheme: https
    tls_config: {ca_file: "$CERTS/ca.pem", cert_file: "$CERTS/prometheus.pem",
                 key_file: "$CERTS/prometheus-key.pem"}
    static_configs: [{targets: ["127.0.0.1:$W1", "127.0.0.1:$W2"]}]
YAML
promtool check config "$WORK/prometheus.yml" >/dev/null
prometheus --config.file "$WORK/prometheus.yml" --storage.tsdb.path "$WORK/tsdb" \
  --web.listen-address "127.0.0.1:$PP" >"$WORK/prometheus.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/prometheus.log" "Server is ready to receive web requests" 60

# 2 workers x 3200 samples x 3 epochs of batch 64: ~150 sync steps, long
# enough for several 1 s scrapes while it trains.
cat >"$WORK/job.json" <<JSON
{"name": "prometheus-test", "model_file": "$SRC/examples/models/fmnist-cnn.json",
 "dataset": {"format": "DATASET_FORMAT_IDX", "path": "/usr/share/datasets/fashion-mnist",
             "mean": [0.2860], "std": [0.3530], "train_limit": 6400, "test_limit": 256},
 "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.01, "momentum": 0.9},
 "epochs": 3, "batch_size": 64, "seed": 1, "workers": 2, "mode": "CONSISTENCY_SYNC"}
JSON
"$BIN/pstrain" --server "$SERVER" submit "$WORK/job.json" --workers 2 --json \
  >"$WORK/submit.log" 2>&1
wait_for "$WORK/worker1.log" "epoch 1/" 300

# 1. promtool lint on live text (after training started, so every series exists).
for port in "$SM" "$W1"; do
  if curl -sf --max-time 5 --cacert "$CERTS/ca.pem" "https://127.0.0.1:$port/metrics" \
    >/dev/null 2>&1; then
    echo "FAIL: /metrics on 127.0.0.1:$port answered a scraper without a client certificate"; exit 1
  fi
  curl -sf --cacert "$CERTS/ca.pem" --cert "$CERTS/prometheus.pem" \
    --key "$CERTS/prometheus-key.pem" "https://127.0.0.1:$port/metrics" >"$WORK/metrics-$port.txt"
  if ! promtool check metrics <"$WORK/metrics-$port.txt" >"$WORK/promtool-$port.txt" 2>&1; then
    echo "FAIL: promtool check metrics on 127.0.0.1:$port:"; cat "$WORK/promtool-$port.txt"; exit 1
  fi
done
echo "ok: promtool check metrics passes for the server and a worker (HTTPS, client certificate)"
# Plain HTTP on the TLS port gets nothing.
if curl -sf --max-time 5 "http://127.0.0.1:$SM/metrics" >/dev/null 2>&1; then
  echo "FAIL: /metrics answered plain HTTP while serving TLS"; exit 1
fi

# 2. Prometheus has the series and they change while the job trains.
python3 - "$PP" "$W1" "$W2" <<'PY'
import json, sys, time, urllib.parse, urllib.request
port, w1, w2 = sys.argv[1:4]
def query(expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1])
            for s in body["data"]["result"]}
checks = {
    "samples/s per worker": ("pstrain_worker_samples_per_second", 2),
    "model version": ('pstrain_server_model_version{job!=""}', 1),
    "push latency count": ("pstrain_server_push_latency_seconds_count", 1),
    "pull latency count": ("pstrain_server_pull_latency_seconds_count", 1),
    "worker push phase": ('pstrain_worker_step_phase_seconds_count{phase="push"}', 2),
    "worker GPU count": ("pstrain_worker_gpus", 2),
}
first = {}
deadline = time.time() + 120
for name, (expr, n) in checks.items():
    while True:
        got = query(expr)
        if len(got) >= n: break
        if time.time() > deadline: sys.exit(f"FAIL: {name}: {expr} has {len(got)} series, want {n}")
        time.sleep(1)
    first[name] = got
    print(f"ok: {name}: {expr} -> {got}")
# Every worker is scraped (job="pstrain-worker" targets are up).
up = query('up{job="pstrain-worker"} == 1')
assert len(up) == 2, f"FAIL: workers up: {up}"
# Change over time: wait for the values to move while training continues.
must_change = ["samples/s per worker", "model version", "push latency count",
               "worker push phase"]
deadline = time.time() + 180
pending = set(must_change)
while pending and time.time() < deadline:
    time.sleep(2)
    for name in list(pending):
        expr = checks[name][0]
        now = query(expr)
        moved = [k for k, v in now.items() if k in first[name] and v != first[name][k]]
        if len(moved) >= (2 if name.startswith("samples") or name.startswith("worker") else 1):
            print(f"ok: {name} changed: {first[name]} -> {now}")
            pending.discard(name)
if pending:
    sys.exit(f"FAIL: did not change while training: {sorted(pending)}")
# The versions must also have gone up in Prometheus's own history.
inc = query('max(max_over_time(pstrain_server_model_version[5m]) - min_over_time(pstrain_server_model_version[5m]))')
assert inc and max(inc.values()) > 0, f"FAIL: model version never increased: {inc}"
print("ok: model version increased by", max(inc.values()))
PY
echo "PASS"
