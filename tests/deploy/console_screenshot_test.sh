#!/usr/bin/env bash
# The console dashboard against a live cluster, rendered in headless Chromium.
#
# Usage: console_screenshot_test.sh SOURCE_DIR BIN_DIR WORK_DIR
#
# Starts a real pstrain-server and two pstrain-workers on 127.0.0.1 (free
# ports), a real Prometheus with the shipped prometheus.yml and rules.yml
# (scrape interval lowered to 1s, targets pointed at the loopback ports) and
# the shipped consoles, and submits a Fashion-MNIST job. Once Prometheus holds
# moving samples/s and model-version series it:
#   1. fetches /consoles/pstrain.html and checks the worker rows carry the same
#      samples/s the HTTP API returns, and "no GPU" exactly when
#      sum(pstrain_worker_gpus) is 0;
#   2. renders the page in headless Chromium (--dump-dom) and checks that the
#      throughput and loss graphs drew SVG paths from the data;
#   3. takes a screenshot (WORK_DIR/pstrain-console.png, never committed) and
#      checks it is not blank (size, luma spread, coloured graph pixels).
# Fails when prometheus, promtool or chromium is missing: install them with
# PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh.
set -euo pipefail
SRC=$(cd "$1" && pwd)
BIN=$(cd "$2" && pwd)
WORK=$3
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/prometheus/targets" "$WORK/state"

fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in prometheus chromium python3 curl; do
  command -v "$tool" >/dev/null ||
    fail "$tool is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
done
CONSOLE_LIBS=""
for d in /usr/share/prometheus/console_libraries /usr/share/doc/prometheus/examples/console_libraries \
  /etc/prometheus/console_libraries; do
  [[ -f "$d/prom.lib" ]] && { CONSOLE_LIBS=$d; break; }
done
[[ -n "$CONSOLE_LIBS" ]] || fail "Prometheus' console_libraries (prom.lib) not found"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
PIDS=()
cleanup() {
  if ((${#PIDS[@]})); then
    kill -TERM "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
      alive=0
      for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
    kill -KILL "${PIDS[@]}" 2>/dev/null || true
  fi
}
trap cleanup EXIT
dump_logs() {
  for f in "$WORK"/logs/*.log; do echo "--- $f"; tail -15 "$f"; done >&2
}
wait_for_log() {  # FILE PATTERN SECONDS
  for _ in $(seq $(($3 * 10))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  dump_logs
  fail "timed out waiting for '$2' in $1"
}

# Phase 1: the cluster, as deployed: TLS, mTLS, tokens, HTTPS /metrics that
# wants a client certificate.
CERTS=$WORK/certs
"$SRC/deploy/local/make-certs.sh" "$CERTS" >/dev/null
export PSTRAIN_TLS_CA=$CERTS/ca.pem PSTRAIN_TLS_CERT=$CERTS/admin.pem \
  PSTRAIN_TLS_KEY=$CERTS/admin-key.pem PSTRAIN_TOKEN_FILE=$CERTS/admin.token
PORT=$(free_port)
SERVER_METRICS=$(free_port)
"$BIN/pstrain-server" --listen "127.0.0.1:$PORT" --metrics-port "$SERVER_METRICS" \
  --state-dir "$WORK/state" --tls-cert "$CERTS/server.pem" --tls-key "$CERTS/server-key.pem" \
  --tls-ca "$CERTS/ca.pem" --require-client-cert --token-file "$CERTS/tokens" \
  >"$WORK/logs/server.log" 2>&1 &
PIDS+=($!)
wait_for_log "$WORK/logs/server.log" "listening on" 60
WORKER_METRICS=()
for w in 1 2; do
  WORKER_METRICS+=("$(free_port)")
  "$BIN/pstrain-worker" --server "127.0.0.1:$PORT" --metrics-port "${WORKER_METRICS[-1]}" \
    --device auto --threads 1 --tls-ca "$CERTS/ca.pem" --tls-cert "$CERTS/worker.pem" \
    --tls-key "$CERTS/worker-key.pem" --require-client-cert --token-file "$CERTS/worker.token" \
    >"$WORK/logs/worker$w.log" 2>&1 &
  PIDS+=($!)
done
wait_for_log "$WORK/logs/worker1.log" "registered" 60
wait_for_log "$WORK/logs/worker2.log" "registered" 60

# Phase 2: Prometheus with the shipped configuration, rules and consoles
# (the CA and Prometheus' client certificate where this run keeps them,
# instead of /etc/prometheus/certs).
PROM_PORT=$(free_port)
sed -e 's/^\(  *scrape_interval:\).*/\1 1s/' -e 's/^\(  *evaluation_interval:\).*/\1 1s/' \
  -e "s/localhost:9090/127.0.0.1:$PROM_PORT/" -e "s|/etc/prometheus/certs/|$CERTS/|" \
  "$SRC/deploy/prometheus/prometheus.yml" >"$WORK/prometheus/prometheus.yml"
cp "$SRC/deploy/prometheus/rules.yml" "$WORK/prometheus/rules.yml"
cat >"$WORK/prometheus/targets/servers.json" <<EOF
[{"targets": ["127.0.0.1:$SERVER_METRICS"], "labels": {"role": "server", "shard": "0"}}]
EOF
cat >"$WORK/prometheus/targets/workers.json" <<EOF
[{"targets": ["127.0.0.1:${WORKER_METRICS[0]}", "127.0.0.1:${WORKER_METRICS[1]}"],
  "labels": {"role": "worker"}}]
EOF
prometheus --config.file="$WORK/prometheus/prometheus.yml" \
  --storage.tsdb.path="$WORK/prometheus/data" \
  --web.listen-address="127.0.0.1:$PROM_PORT" \
  --web.console.templates="$SRC/deploy/prometheus/consoles" \
  --web.console.libraries="$CONSOLE_LIBS" >"$WORK/logs/prometheus.log" 2>&1 &
PIDS+=($!)
PROM="http://127.0.0.1:$PROM_PORT"
for _ in $(seq 300); do
  curl -sf "$PROM/-/ready" >/dev/null && break
  sleep 0.1
done
curl -sf "$PROM/-/ready" >/dev/null || { dump_logs; fail "Prometheus did not become ready"; }

# Phase 3: train, and wait until the data flows.
"$BIN/pstrain" --server "127.0.0.1:$PORT" submit "$SRC/examples/fashion-mnist.json" \
  --workers 2 --mode async --epochs 3 >"$WORK/logs/submit.log" 2>&1 ||
  { dump_logs; fail "pstrain submit failed"; }

query() {  # query PROMQL -> the first sample's value, or "" when empty
  curl -sf --get "$PROM/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")'
}
first_version=""
ready=0
for _ in $(seq 240); do
  up=$(query 'sum(up{job=~"pstrain-.*"})')
  flowing=$(query 'count(pstrain_worker_samples_per_second > 0)')
  version=$(query 'max(pstrain_server_model_version)')
  if [[ "$up" == 3 && "$flowing" == 2 && -n "$version" ]]; then
    [[ -z "$first_version" ]] && first_version=$version
    if python3 -c "import sys; sys.exit(0 if float('$version') > float('$first_version') else 1)"; then
      ready=1
      break
    fi
  fi
  sleep 1
done
((ready)) || { dump_logs; fail "no moving samples/s and model version in Prometheus (up=$up flowing=$flowing version=$version)"; }
echo "data flows: model version $first_version -> $version"
sleep 12  # Let the graphs gather a few points and the 30s rate windows fill.

# Phase 4: the server-rendered console page.
URL="$PROM/consoles/pstrain.html"
curl -sf "$URL" >"$WORK/pstrain.html" || fail "GET $URL failed"
html=$WORK/pstrain.html
grep -q "pstrain training" "$html" || fail "console page has no title"
grep -qi "error executing template\|template: " "$html" && fail "console template error: $(grep -i template "$html" | head -3)"
rows=$(grep -c 'class="pstrain-worker-row"' "$html" || true)
[[ "$rows" == 2 ]] || fail "expected 2 worker rows, got $rows"
for p in "${WORKER_METRICS[@]}"; do
  grep -q "127.0.0.1:$p" "$html" || fail "worker 127.0.0.1:$p missing from the console page"
done
gpus=$(query 'sum(pstrain_worker_gpus)')
[[ -n "$gpus" ]] || fail "pstrain_worker_gpus is not exported by the workers"
if [[ "$gpus" == 0 ]]; then
  grep -q 'id="pstrain-gpu-none"' "$html" || fail "no 'no GPU' notice although pstrain_worker_gpus is 0"
  no_gpu_cells=$(grep -c 'class="pstrain-no-gpu">no GPU' "$html" || true)
  ((no_gpu_cells >= 2)) || fail "worker rows do not read 'no GPU' ($no_gpu_cells cells)"
else
  grep -q 'id="pstrain-gpu-none"' "$html" && fail "'no GPU' notice although pstrain_worker_gpus is $gpus"
  [[ -n "$(query 'count(pstrain_worker_gpu_utilization_ratio)')" ]] ||
    fail "workers have $gpus GPUs but export no utilization"
fi
# Every worker row shows a samples/s figure (not "-") and a loss.
python3 - "$html" <<'EOF' || fail "worker rows lack samples/s or loss figures"
import re, sys
html = open(sys.argv[1]).read()
cells = re.findall(r'class="text-right pstrain-(samples|loss)">\s*<a[^>]*>([^<]*)</a>', html)
values = [v.strip() for _, v in cells]
print("console cells:", cells)
sys.exit(0 if len(values) == 4 and all(v and v != "-" for v in values) else 1)
EOF

# Phase 5: every query of the Grafana dashboard parses and runs on this
# Prometheus (Grafana's $__rate_interval and $worker variables filled in),
# and its throughput, loss and model-version panels return data.
python3 - "$SRC/deploy/grafana/pstrain-dashboard.json" "$PROM" <<'EOF' || fail "Grafana dashboard queries"
import json, sys, urllib.error, urllib.parse, urllib.request
dash, prom = json.load(open(sys.argv[1])), sys.argv[2]
ids = [p["id"] for p in dash["panels"]]
ok = len(ids) == len(set(ids))
for panel in dash["panels"]:
    for target in panel["targets"]:
        expr = target["expr"].replace("$__rate_interval", "30s").replace("$worker", ".*")
        url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.load(urllib.request.urlopen(url))
        except urllib.error.HTTPError as e:
            print("%s: %s: %s" % (panel["title"], expr, e.read().decode()))
            ok = False
            continue
        if panel["title"] in ("Throughput (samples/s)", "Training loss", "Model version") \
                and not body["data"]["result"]:
            print("%s: no data for %s" % (panel["title"], expr))
            ok = False
print("grafana: %d panels, queries %s" % (len(ids), "ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
EOF

# Phase 6: the page as a browser draws it.
# The graphs show the last minute (the console's time control reads the
# URL fragment), so the run's data spans them rather than a sliver of an hour.
VIEW="$URL#pctc%7B%22duration%22%3A60%2C%22endTime%22%3A0%7D"
CHROME=(chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars
  --user-data-dir="$WORK/chromium" --virtual-time-budget=20000 --window-size=1280,3000)
"${CHROME[@]}" --dump-dom "$VIEW" >"$WORK/pstrain.dom.html" 2>"$WORK/logs/chromium-dom.log" ||
  fail "chromium --dump-dom failed: $(tail -5 "$WORK/logs/chromium-dom.log")"
python3 - "$WORK/pstrain.dom.html" <<'EOF' || fail "graphs were not drawn with data"
import re, sys
dom = open(sys.argv[1]).read()
ok = True
for graph in ["pstrainSamplesGraph", "pstrainLossGraph", "pstrainVersionGraph", "pstrainLatencyGraph"]:
    start = dom.find('id="%s"' % graph)
    end = dom.find("<script", start)
    section = dom[start:end] if start >= 0 else ""
    paths = re.findall(r'<path[^>]* d="M[^"]{20,}"', section)
    print("%s: %d data paths" % (graph, len(paths)))
    ok = ok and len(paths) > 0
sys.exit(0 if ok else 1)
EOF
SHOT=$WORK/pstrain-console.png
"${CHROME[@]}" --screenshot="$SHOT" "$VIEW" >"$WORK/logs/chromium-shot.log" 2>&1 ||
  fail "chromium --screenshot failed: $(tail -5 "$WORK/logs/chromium-shot.log")"
[[ -s "$SHOT" ]] || fail "no screenshot written"
bytes=$(stat -c %s "$SHOT")
stats=$(python3 "$SRC/tests/deploy/png_stats.py" "$SHOT") || fail "screenshot is not a readable PNG"
echo "screenshot $SHOT: $bytes bytes, $stats"
python3 - "$stats" "$bytes" <<'EOF' || fail "screenshot looks blank"
import json, sys
s, size = json.loads(sys.argv[1]), int(sys.argv[2])
ok = (size > 50000 and s["distinct_colors"] > 30 and s["luma_stddev"] > 10
      and s["colored_fraction"] > 0.01)
sys.exit(0 if ok else 1)
EOF
echo "PASS: console dashboard rendered with data ($URL)"
