#!/usr/bin/env bash
# The README's main-job command. On a fresh machine it installs what it needs
# and builds, then starts one pstrain-server and two pstrain-worker daemons on
# 127.0.0.1, submits the Fashion-MNIST job (examples/fashion-mnist.json) in
# sync mode, shows the progress bar and the final metrics, and stops
# everything cleanly (Ctrl-C included). Workers train on the GPU when one is
# present, else on the CPU. Every channel runs as a cluster should: TLS with
# client certificates (mTLS) and per-role tokens, made for this run by
# deploy/local/make-certs.sh in STATE_DIR/certs; /metrics is HTTPS and
# wants a client certificate too (Prometheus scrapes with its own).
#
# Environment: PSTRAIN_PORT (server port, default: a free one),
# PSTRAIN_STATE_DIR (default: a temporary directory), PSTRAIN_EPOCHS (override
# the job's epochs), PSTRAIN_MODE (sync|async|ssp|average, default sync).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
deploy/local/install-deps.sh
echo "main-job: building (build/)..."
deploy/local/build.sh >/tmp/pstrain-build.log 2>&1 || { tail -30 /tmp/pstrain-build.log; exit 1; }
BIN="$ROOT/build/bin"

# A 127.0.0.1 port nothing listens on (bash only: the main job needs no
# Python). A port taken between this check and the daemon's bind makes the
# daemon fail with "cannot listen on", and the run stops there.
free_port() {
  local port
  for _ in $(seq 200); do
    port=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  echo "main-job: found no free port on 127.0.0.1" >&2
  return 1
}
PORT=${PSTRAIN_PORT:-$(free_port)}
STATE_DIR=${PSTRAIN_STATE_DIR:-$(mktemp -d /tmp/pstrain-state.XXXXXX)}
LOG_DIR="$STATE_DIR/logs"
mkdir -p "$LOG_DIR"
SERVER="127.0.0.1:$PORT"

PIDS=()
cleanup() {
  trap - INT TERM EXIT
  if ((${#PIDS[@]})); then
    echo "main-job: stopping server and workers..."
    kill -TERM "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
      alive=0
      for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
    kill -KILL "${PIDS[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  echo "main-job: logs and checkpoints are in $STATE_DIR"
}
trap cleanup EXIT
trap 'echo; echo "main-job: interrupted"; exit 130' INT TERM

wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "main-job: timed out waiting for '$2' in $1:"; tail -20 "$1"; return 1
}

CERTS="$STATE_DIR/certs"
deploy/local/make-certs.sh "$CERTS" >/dev/null
SERVER_TLS=(--tls-cert "$CERTS/server.pem" --tls-key "$CERTS/server-key.pem" --tls-ca "$CERTS/ca.pem"
  --require-client-cert --token-file "$CERTS/tokens")
WORKER_TLS=(--tls-ca "$CERTS/ca.pem" --tls-cert "$CERTS/worker.pem" --tls-key "$CERTS/worker-key.pem"
  --require-client-cert --token-file "$CERTS/worker.token")
# The CLI reads these (the admin's certificate and token).
export PSTRAIN_TLS_CA="$CERTS/ca.pem" PSTRAIN_TLS_CERT="$CERTS/admin.pem" \
  PSTRAIN_TLS_KEY="$CERTS/admin-key.pem" PSTRAIN_TOKEN_FILE="$CERTS/admin.token"

SERVER_METRICS_PORT=$(free_port)
"$BIN/pstrain-server" --listen "$SERVER" --metrics-port "$SERVER_METRICS_PORT" --state-dir "$STATE_DIR" \
  "${SERVER_TLS[@]}" >"$LOG_DIR/server.log" 2>&1 &
PIDS+=($!)
wait_for "$LOG_DIR/server.log" "listening on" 60

NPROC=$(nproc)
THREADS=$(( NPROC / 2 > 0 ? NPROC / 2 : 1 ))
WORKER_METRICS_PORTS=()
for w in 1 2; do
  WORKER_METRICS_PORTS+=("$(free_port)")
  "$BIN/pstrain-worker" --server "$SERVER" --metrics-port "${WORKER_METRICS_PORTS[-1]}" --device auto \
    --threads "$THREADS" "${WORKER_TLS[@]}" >"$LOG_DIR/worker$w.log" 2>&1 &
  PIDS+=($!)
done
wait_for "$LOG_DIR/worker1.log" "registered" 60
wait_for "$LOG_DIR/worker2.log" "registered" 60
echo "main-job: server $SERVER (TLS, mTLS, tokens), 2 workers registered; logs in $LOG_DIR"

# Prometheus, when installed: deploy/prometheus's rules and console dashboard,
# with a scrape config generated for this run's metrics ports.
if command -v prometheus >/dev/null; then
  PROM_DIR="$STATE_DIR/prometheus"
  # Debian ships the console libraries with the examples.
  CONSOLE_LIBS=/usr/share/prometheus/console_libraries
  [[ -d $CONSOLE_LIBS ]] || CONSOLE_LIBS=/usr/share/doc/prometheus/examples/console_libraries
  PROM_PORT=${PSTRAIN_PROMETHEUS_PORT:-$(free_port)}
  mkdir -p "$PROM_DIR"
  worker_targets=$(printf '"127.0.0.1:%s", ' "${WORKER_METRICS_PORTS[@]}")
  cat >"$PROM_DIR/prometheus.yml" <<YAML
global: {scrape_interval: 2s, evaluation_interval: 2s, external_labels: {system: pstrain}}
rule_files: ["$ROOT/deploy/prometheus/rules.yml"]
scrape_configs:
  - job_name: pstrain-server
    scheme: https
    tls_config: {ca_file: "$CERTS/ca.pem", server_name: localhost,
                 cert_file: "$CERTS/prometheus.pem", key_file: "$CERTS/prometheus-key.pem"}
    static_configs: [{targets: ["127.0.0.1:$SERVER_METRICS_PORT"]}]
    metric_relabel_configs:
      - {source_labels: [exported_job], regex: (.+), target_label: pstrain_job}
  - job_name: pstrain-worker
    scheme: https
    tls_config: {ca_file: "$CERTS/ca.pem", server_name: localhost,
                 cert_file: "$CERTS/prometheus.pem", key_file: "$CERTS/prometheus-key.pem"}
    static_configs: [{targets: [${worker_targets%, }]}]
    metric_relabel_configs:
      - {source_labels: [exported_job], regex: (.+), target_label: pstrain_job}
YAML
  prometheus --config.file "$PROM_DIR/prometheus.yml" --storage.tsdb.path "$PROM_DIR/data" \
    --web.listen-address "127.0.0.1:$PROM_PORT" \
    --web.console.templates "$ROOT/deploy/prometheus/consoles" \
    --web.console.libraries "$CONSOLE_LIBS" \
    >"$LOG_DIR/prometheus.log" 2>&1 &
  PIDS+=($!)
  if wait_for "$LOG_DIR/prometheus.log" "Server is ready to receive web requests" 60; then
    echo "main-job: dashboard: http://127.0.0.1:$PROM_PORT/consoles/pstrain.html"
  fi
else
  echo "main-job: Prometheus is not installed (apt-get install prometheus): no dashboard"
fi

EXTRA=()
[[ -n "${PSTRAIN_EPOCHS:-}" ]] && EXTRA+=(--epochs "$PSTRAIN_EPOCHS")
set +e
"$BIN/pstrain" --server "$SERVER" submit examples/fashion-mnist.json --workers 2 \
  --mode "${PSTRAIN_MODE:-sync}" --watch "${EXTRA[@]}" "$@"
status=$?
set -e
exit $status
