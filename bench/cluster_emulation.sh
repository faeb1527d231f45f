#!/usr/bin/env bash
# An emulated cluster on one machine (issue 11 part 4; the TLS figure of
# issue 8). Every pstrain-server and every pstrain-worker runs in a Linux
# network namespace of its own; each namespace's eth0 is one end of a veth
# pair whose other end is a port of a bridge inside a namespace of this
# script's own (the switch). Every host link is rate-limited in both
# directions with tc tbf (RATE, e.g. 1gbit) on both ends of its veth pair,
# plus netem delay (DELAY_MS) where the kernel has netem. TCP in the
# namespaces is loss-based, as on a stock Linux host: cubic where the host
# lets namespaces pick it (net.ipv4.tcp_allowed_congestion_control), else
# reno (TCP_CC overrides); namespaces otherwise inherit the host's default,
# which on these VMs is bbr, and bbr overfills the 20 ms queues (15 % of
# segments retransmitted at N = 8, S = 8). Addresses are
# 10.77.0.0/24, inside those namespaces only: servers 10.77.0.10+i, workers
# 10.77.0.101+i. Nothing is created in the host's namespace (veths are
# created straight into their namespaces) and everything is removed on exit,
# Ctrl-C or failure (trap: processes, then namespaces, which takes their
# veths and the bridge with them).
#
# Workers run the real daemon, client, wire and server, but with the
# BENCH-ONLY command-line flag --bench_only_fixed_compute_ms=FIXED_MS: every
# step after the first sleeps FIXED_MS instead of forward/backward and pushes
# the first step's gradients again (the model does not learn), so that the
# network, not the 2 cores, is the bottleneck. No job spec can set it. Every
# line this script prints carries "bench_only_fixed_compute_ms=<value>" (0
# for the Fashion-MNIST runs, which train for real).
#
# Per point (N workers, S shards, a codec) it submits JOB (default
# bench/jobs/dense-8mb-synthetic.json: one 8 MB dense layer; bench/jobs/
# mlp-8mb-synthetic.json spreads as many bytes over five layers, whose
# gradients a step pushes last layer first; bench/jobs/dense-32mb-synthetic.json
# is one 34 MB layer, for 16 shards: 8 MB there leaves each shard 8 chunks
# of AutoChunkBytes' 64 KiB floor, not 16) in sync mode, skips WARM steps,
# then measures K steps: the step time is the median interval between
# worker 1's step ends (its per-step BENCH ONLY log lines); the bytes each
# link carried per step are the veth counters (tx + rx of every host's eth0:
# headers, gRPC framing, heartbeats and TLS records included) over the same
# window, divided by the steps in it. Two bounds the links allow, each FIXED_MS + the busiest link's
# time: "serial" counts a link's two directions one after the other (each
# worker's link carries its push and then its pull; each server's link its
# share of every worker's push, then of every pull); "duplex" counts each
# direction alone, the lowest step time full-duplex links allow whatever the
# schedule. retrans_% is the share of TCP segments all hosts retransmitted
# in the window (nstat). barrier_wait_ms is the mean time a chunk's sync
# barrier waited from its first worker's push to its last, and
# barriers_per_step how many completed per step, over every server (their
# /metrics, pstrain_server_barrier_wait_seconds: what the slowest worker of
# each chunk costs the others).
#
# Usage: bench/cluster_emulation.sh smoke|sweep|tls|fmnist|torch|all
#   smoke   N=2, S=2, no compression, a few steps (< 60 s); run by ctest
#   sweep   N = 1 2 4 8 (NS_LIST), S = 1 2 4 (SS_LIST), codecs none and onebit
#           (CODECS: push codecs, PUSH/PULL adds --pull-compression, e.g.
#           "none fp16/fp16 onebit/onebit"), at RATE
#   tls     TLS + mTLS + tokens vs plaintext at N=1,S=1 and N=2,S=2 over
#           10gbit and 1gbit links (TLS_RATES; TLS_SIZES="1:1 2:2", N:S), servers pinned to core 0 and
#           workers to core 1, or, with CORES_PER_HOST=K, each host to K
#           cores of its own (a machine with enough cores: separate hosts);
#           CERTS_DIR: certificates made beforehand (make-certs.sh --name
#           10.77.0.10 ... --name 10.77.0.20), where openssl is missing
#   fmnist  examples/fashion-mnist.json (constant lr) with 2 workers and 2
#           shards at 1gbit, real training, each codec: test accuracy after
#           each epoch (epoch checkpoints evaluated afterwards) and the time
#           to 0.90
#   torch   pstrain.torch against DDP (gloo) with torchvision's ResNet-18
#           (synthetic 3x64x64, TORCH_BATCH=16 per worker, sync SGD with
#           momentum), real compute: each worker process in a namespace of
#           its own (one thread), pstrain's servers in others; N =
#           TORCH_NS ("2 4"), sides TORCH_SIDES ("ddp:none ddp:fp16
#           pstrain:none pstrain:fp16/fp16 pstrain:topk:0.01
#           pstrain:topk:0.01/fp16"; ddp:fp16 is DDP's
#           fp16_compress_hook, pstrain's codec PUSH[/PULL] as for submit),
#           each pstrain side with S servers for S in TORCH_SERVERS ("1 N":
#           one, and one per worker as BytePS places them), TORCH_ROUNDS (2)
#           rounds alternating the order, TORCH_STEPS (12) steps per worker
#           after TORCH_WARM (3); the median step time over the workers'
#           medians, each worker's CPU per step (its process, every thread)
#           and the servers' CPU per step (all of them, the whole job over
#           its steps): on a host with fewer cores than processes, the CPU a
#           step costs outside the training thread is on the step's path.
#           Side pstrain-serial: pstrain without overlapped pulls.
#           TORCH_PYTHON: the python3 to run them with.
# RATE=100mbit FIXED_MS=100 is the same cluster slowed ten times (a tenth
# of the work per second for the daemons, veths and tbf on this host).
# Environment (defaults): RATE=1gbit DELAY_MS=0.1 FIXED_MS=10 CODECS="none
#   onebit" NS_LIST="1 2 4 8" SS_LIST="1 2 4" WINDOW_S=4 WARM=19
#   FMNIST_EPOCHS=3 FMNIST_CODECS="none fp16 bf16 topk:0.01 onebit"
#   PSTRAIN_BIN=build/bin PSTRAIN_BENCH_OUT=/tmp/pstrain-cluster-emulation
#   JOB=bench/jobs/dense-8mb-synthetic.json (smoke, sweep and tls)
#   TCP_CC=cubic (reno where namespaces may not use cubic)
#   QUEUE_MS=20 QUEUE_MIN_BYTES=262144: each link's tbf queue, in time at
#   its rate, at least that many bytes.
#   WORKER_ARGS: more pstrain-worker flags (e.g. --connections-per-shard=2);
#   SERVER_ARGS: more pstrain-server flags (e.g. --push-pacing-lead=0).
#   SERVER_RATE=RATE: the servers' links (servers often have faster NICs
#   than workers); the bounds use each host's own rate.
# Host TCP settings to try (none by default): SERVER_SYSCTLS and
#   WORKER_SYSCTLS, ';'-separated key=value pairs set in each server's or
#   worker's namespace (e.g. "net.ipv4.tcp_wmem=4096 16384 65536"), and
#   ROUTE_OPTS, options of every host's route to the others (e.g.
#   "rto_min 5ms"). rto_per_step counts TCP retransmission timeouts.
# TRACE_S=0: seconds of worker 1's packet headers to capture after each
#   point's window (bench/link_trace.py), then report per step how long its
#   push took against its link time, when each shard's connection finished,
#   and how long the pull ran on after the push: medians printed, every step
#   in the point's cluster.*/trace-w1.report.
# Exit 77 (ctest's SKIP_RETURN_CODE) with the reason when this machine cannot
# make network namespaces, veths, bridges or tbf (not root, no iproute2...).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHAT=${1:-smoke}
BIN=${PSTRAIN_BIN:-"$ROOT/build/bin"}
OUT=${PSTRAIN_BENCH_OUT:-/tmp/pstrain-cluster-emulation}
RATE=${RATE:-1gbit}
DELAY_MS=${DELAY_MS:-0.1}
FIXED_MS=${FIXED_MS:-10}
WINDOW_S=${WINDOW_S:-4}
# 19: after the first trial of the servers' --push-pacing-lead auto
# (versions 2-17; server/pace_lead_tuner.h), so the window sees the lead it chose.
WARM=${WARM:-19}
JOB=${JOB:-"$ROOT/bench/jobs/dense-8mb-synthetic.json"}
# TCP congestion control inside the namespaces: Linux's default (cubic) when
# the host lets namespaces choose it (net.ipv4.tcp_allowed_congestion_control),
# else reno, also loss-based and alike at LAN round-trip times.
if [[ -z ${TCP_CC:-} ]]; then
  TCP_CC=reno
  grep -qw cubic /proc/sys/net/ipv4/tcp_allowed_congestion_control 2>/dev/null && TCP_CC=cubic
fi
TAG="pse$$"  # Prefix of every namespace this run makes.
NET=10.77.0
PORT=7070

skip() { echo "cluster_emulation: SKIP: $*" >&2; exit 77; }
die() { echo "cluster_emulation: error: $*" >&2; exit 1; }
case $WHAT in smoke | sweep | tls | fmnist | torch | all) ;; *) die "unknown mode '$WHAT' (smoke|sweep|tls|fmnist|torch|all)" ;; esac

# --- Can this machine do it? (else exit 77) -----------------------------------
[[ $(id -u) == 0 ]] || skip "needs root for network namespaces (uid $(id -u))"
command -v ip >/dev/null || skip "iproute2's ip is missing"
command -v tc >/dev/null || skip "iproute2's tc is missing"
command -v python3 >/dev/null || skip "python3 is missing"
for b in pstrain-server pstrain-worker pstrain; do
  [[ -x $BIN/$b ]] || die "$BIN/$b is missing: build first"
done
mkdir -p "$OUT"
RUN_DIR=$(mktemp -d "$OUT/run.XXXXXX")

# --- Processes and namespaces, removed on any exit ------------------------------
PIDS=()
NAMESPACES=()
stop_processes() {
  local p deadline
  ((${#PIDS[@]})) || return 0
  kill -TERM "${PIDS[@]}" 2>/dev/null || true
  deadline=$(($(date +%s) + 10))
  for p in "${PIDS[@]}"; do
    while kill -0 "$p" 2>/dev/null && (($(date +%s) < deadline)); do sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  PIDS=()
}
remove_namespaces() {
  local ns
  for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  NAMESPACES=()
}
cleanup() {
  stop_processes
  remove_namespaces
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Probe: a namespace, a veth into a second one, a bridge and a tbf qdisc.
ip netns add "$TAG-probe" 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
NAMESPACES+=("$TAG-probe" "$TAG-probe2")
ip netns add "$TAG-probe2" 2>/dev/null || skip "cannot create a second network namespace"
ip -n "$TAG-probe" link add pv0 type veth peer name eth0 netns "$TAG-probe2" 2>/dev/null ||
  skip "cannot create a veth pair between namespaces"
ip -n "$TAG-probe" link add br0 type bridge 2>/dev/null || skip "cannot create a bridge"
tc -n "$TAG-probe" qdisc add dev pv0 root handle 1: tbf rate 1gbit burst 128kb latency 20ms \
  2>/dev/null || skip "tc tbf is not available in this kernel"
HAVE_NETEM=0
tc -n "$TAG-probe" qdisc add dev pv0 parent 1:1 handle 10: netem delay 0.1ms 2>/dev/null &&
  HAVE_NETEM=1
remove_namespaces
((HAVE_NETEM)) || echo "cluster_emulation: bench_only_fixed_compute_ms=$FIXED_MS note: this" \
  "kernel has no netem qdisc: links are rate-limited (tbf) without added delay" >&2

# --- The network ----------------------------------------------------------------
# rate_bits RATE -> bits per second (tc's units: kbit, mbit, gbit).
rate_bits() {
  python3 -c "
import re, sys
m = re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1])
if not m: sys.exit('bad rate ' + sys.argv[1])
print(int(float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m.group(2)]))" "$1"
}
# shape NS DEV RATE: tbf at RATE on DEV's egress (+ netem delay when present).
shape() {
  local bits burst limit
  bits=$(rate_bits "$3")
  burst=$((bits / 8 / 1000 > 65536 ? bits / 8 / 1000 : 65536))   # 1 ms of traffic, >= 64 KiB.
  local queue_ms=${QUEUE_MS:-20} floor=${QUEUE_MIN_BYTES:-262144}
  limit=$((bits * queue_ms / 8000))  # QUEUE_MS (20) of traffic, at least QUEUE_MIN_BYTES.
  ((limit > floor)) || limit=$floor
  tc -n "$1" qdisc add dev "$2" root handle 1: tbf rate "$3" burst "$burst" limit "$limit"
  if ((HAVE_NETEM)); then
    tc -n "$1" qdisc add dev "$2" parent 1:1 handle 10: netem delay "${DELAY_MS}ms"
  fi
}
# set_sysctl NS KEY=VALUE: a sysctl of namespace NS, through /proc/sys (no
# procps needed: the GPU machine's image may lack it).
set_sysctl() {
  local key=${2%%=*} value=${2#*=}
  ip netns exec "$1" sh -c 'printf "%s\n" "$1" >"$2"' sh "$value" "/proc/sys/${key//.//}" ||
    die "cannot set $key=$value in $1"
}
SW="$TAG-sw"
SERVER_NS=() SERVER_IP=() WORKER_NS=() WORKER_IP=()
# net_up N S RATE: the switch, S server hosts and N worker hosts.
net_up() {
  local n=$1 s=$2 rate=$3 i ns
  remove_namespaces
  ip netns add "$SW"
  NAMESPACES+=("$SW")
  ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  SERVER_NS=() SERVER_IP=() WORKER_NS=() WORKER_IP=()
  for ((i = 0; i < s; i++)); do SERVER_NS+=("$TAG-s$i"); SERVER_IP+=("$NET.$((10 + i))"); done
  for ((i = 1; i <= n; i++)); do WORKER_NS+=("$TAG-w$i"); WORKER_IP+=("$NET.$((100 + i))"); done
  local hosts=("${SERVER_NS[@]}" "${WORKER_NS[@]}") ips=("${SERVER_IP[@]}" "${WORKER_IP[@]}")
  for i in "${!hosts[@]}"; do
    ns=${hosts[$i]}
    ip netns add "$ns"
    NAMESPACES+=("$ns")
    ip -n "$ns" link set lo up
    set_sysctl "$ns" net.ipv4.tcp_congestion_control="$TCP_CC"
    local kv kvs=()
    if ((i < s)); then
      IFS=';' read -ra kvs <<<"${SERVER_SYSCTLS:-}"
    else
      IFS=';' read -ra kvs <<<"${WORKER_SYSCTLS:-}"
    fi
    for kv in "${kvs[@]}"; do [[ -z $kv ]] || set_sysctl "$ns" "$kv"; done
    ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$SW" link set "p$i" master br0 up
    ip -n "$ns" addr add "${ips[$i]}/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [[ -n ${ROUTE_OPTS:-} ]]; then
      # shellcheck disable=SC2086
      ip -n "$ns" route replace "$NET.0/24" dev eth0 proto kernel scope link src "${ips[$i]}" $ROUTE_OPTS
    fi
    local host_rate=$rate
    ((i < s)) && host_rate=${SERVER_RATE:-$rate}
    shape "$SW" "p$i" "$host_rate"  # Switch -> host (the host's downlink).
    shape "$ns" eth0 "$host_rate"   # Host -> switch (its uplink).
  done
}
# link_bytes -> "name tx rx ..." for every host: the bytes its eth0 sent and received.
link_bytes() {
  local ns
  for ns in "${SERVER_NS[@]}" "${WORKER_NS[@]}"; do
    local tx rx
    tx=$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)
    rx=$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)
    echo "${ns#"$TAG"-} $tx $rx"
  done | paste -sd' '
}
# tcp_segs -> "OUT RETRANS RTO": TCP segments sent and retransmitted, and
# retransmission timeouts, of every host.
tcp_segs() {
  local ns
  for ns in "${SERVER_NS[@]}" "${WORKER_NS[@]}"; do
    # /proc/net/snmp and netstat: a line of names, then one of values, per protocol.
    ip netns exec "$ns" cat /proc/net/snmp /proc/net/netstat |
      awk '$1 == "Tcp:" || $1 == "TcpExt:" {
             if (!($1 in names)) { names[$1] = $0; next }
             n = split(names[$1], k); split($0, v)
             for (i = 2; i <= n; i++) val[$1 k[i]] = v[i]
           }
           END {print val["Tcp:OutSegs"] + 0, val["Tcp:RetransSegs"] + 0, val["TcpExt:TCPTimeouts"] + 0}'
  done | awk '{o += $1; r += $2; t += $3} END {print o, r, t}'
}

# barrier_waits -> "SECONDS COUNT": the barrier waits every server's /metrics
# has counted (pstrain_server_barrier_wait_seconds; refreshed each second).
# "0 0" for a server whose /metrics is HTTPS (the tls points).
METRICS_PORT=9100
barrier_waits() {
  local ns
  for ns in "${SERVER_NS[@]}"; do
    ip netns exec "$ns" python3 -c "
import urllib.request
try:
    text = urllib.request.urlopen('http://127.0.0.1:$METRICS_PORT/metrics', timeout=5).read().decode()
except Exception:
    text = ''
v = {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l.startswith('pstrain_server_barrier_wait_seconds_')}
print(v.get('pstrain_server_barrier_wait_seconds_sum', 0), int(v.get('pstrain_server_barrier_wait_seconds_count', 0)))" ||
      echo "0 0"
  done | awk '{s += $1; c += $2} END {print s, c}'
}

# --- The cluster ------------------------------------------------------------------
CERTS=""
# start_cluster N S TLS(0|1) FIXED_MS PIN(0|1) [server args...]: servers, then
# workers; returns once every worker has registered.
start_cluster() {
  local n=$1 s=$2 tls=$3 fixed=$4 pin=$5 i shards="" cpu_s="" cpu_w=""
  shift 5
  stop_processes
  STATE=$(mktemp -d "$RUN_DIR/cluster.XXXXXX")
  for ((i = 0; i < s; i++)); do shards+="${shards:+,}${SERVER_IP[$i]}:$PORT"; done
  SERVER="${SERVER_IP[0]}:$PORT"
  local server_sec=(--insecure) worker_sec=()
  CLI_ENV=()
  if ((tls)); then
    if [[ -z $CERTS && -n ${CERTS_DIR:-} ]]; then
      CERTS=$CERTS_DIR  # Made beforehand with these addresses' names (no openssl here).
    elif [[ -z $CERTS ]]; then
      CERTS="$RUN_DIR/certs"
      local names=() k
      for k in $(seq 10 20); do names+=(--name "$NET.$k"); done
      "$ROOT/deploy/local/make-certs.sh" "$CERTS" "${names[@]}" >"$RUN_DIR/make-certs.log" 2>&1 ||
        die "make-certs failed: $(tail -3 "$RUN_DIR/make-certs.log")"
    fi
    server_sec=(--tls-cert "$CERTS/server.pem" --tls-key "$CERTS/server-key.pem"
      --tls-ca "$CERTS/ca.pem" --require-client-cert --token-file "$CERTS/tokens")
    worker_sec=(--tls-ca "$CERTS/ca.pem" --tls-cert "$CERTS/worker.pem"
      --tls-key "$CERTS/worker-key.pem" --token-file "$CERTS/worker.token")
    CLI_ENV=(PSTRAIN_TLS_CA="$CERTS/ca.pem" PSTRAIN_TLS_CERT="$CERTS/admin.pem"
      PSTRAIN_TLS_KEY="$CERTS/admin-key.pem" PSTRAIN_TOKEN_FILE="$CERTS/admin.token")
  fi
  if ((pin)); then cpu_s=(taskset -c 0) cpu_w=(taskset -c 1); else cpu_s=() cpu_w=(); fi
  for ((i = 0; i < s; i++)); do
    ((pin)) && [[ -n ${CORES_PER_HOST:-} ]] && cpu_s=(taskset -c "$(host_cores "$i")")
    ip netns exec "${SERVER_NS[$i]}" nice -n 10 "${cpu_s[@]}" "$BIN/pstrain-server" \
      --listen "${SERVER_IP[$i]}:$PORT" --shards "$shards" --shard-index "$i" \
      --metrics-port "$METRICS_PORT" \
      --state-dir "$STATE/state$i" "${server_sec[@]}" ${SERVER_ARGS:-} "$@" >"$STATE/server$i.log" 2>&1 &
    PIDS+=($!)
  done
  for ((i = 0; i < s; i++)); do
    wait_for "server $i listening" 30 port_open "${SERVER_NS[$i]}" "${SERVER_IP[$i]}"
  done
  local fixed_flag=()
  ((fixed > 0)) && fixed_flag=(--bench_only_fixed_compute_ms="$fixed")
  for ((i = 0; i < n; i++)); do
    ((pin)) && [[ -n ${CORES_PER_HOST:-} ]] && cpu_w=(taskset -c "$(host_cores $((s + i)))")
    ip netns exec "${WORKER_NS[$i]}" nice -n 10 "${cpu_w[@]}" "$BIN/pstrain-worker" \
      --server "$SERVER" --device cpu --threads 1 "${fixed_flag[@]}" "${worker_sec[@]}" \
      ${WORKER_ARGS:-} \
      >"$STATE/worker$((i + 1)).log" 2>&1 &
    PIDS+=($!)
  done
  local logs=()  # Named, not globbed: a background job creates its log later.
  for ((i = 1; i <= n; i++)); do logs+=("$STATE/worker$i.log"); done
  wait_for "workers registered" 60 all_logs_say "registered as" "${logs[@]}"
}
# host_cores I -> the cores of host I (servers first, then workers) with
# CORES_PER_HOST=K: K cores each, in order, wrapping around the machine's.
host_cores() {
  local k=$CORES_PER_HOST total first c list=""
  total=$(nproc)
  first=$(($1 * k))
  for ((c = first; c < first + k; c++)); do list+="${list:+,}$((c % total))"; done
  echo "$list"
}
port_open() {  # port_open NS IP: a TCP connection to IP:PORT from NS succeeds.
  ip netns exec "$1" timeout 2 bash -c "exec 3<>/dev/tcp/$2/$PORT" 2>/dev/null
}
all_logs_say() {
  local text=$1 f
  shift
  for f in "$@"; do grep -q "$text" "$f" 2>/dev/null || return 1; done
}
# wait_for WHAT SECONDS COMMAND...: polls COMMAND every POLL_S (0.1) s until it
# succeeds; fails the run after SECONDS.
wait_for() {
  local what=$1 deadline=$(($(date +%s) + $2))
  shift 2
  until "$@"; do
    (($(date +%s) < deadline)) || die "timed out waiting for $what (logs: $STATE)"
    sleep "${POLL_S:-0.1}"
  done
}
cli() { ip netns exec "${SERVER_NS[0]}" env "${CLI_ENV[@]}" "$BIN/pstrain" --server "$SERVER" --timeout-ms 10000 "$@"; }
submit() {  # submit JOB N CODEC [extra...] -> job id; CODEC: PUSH[/PULL] (fp16/fp16)
  local job=$1 n=$2 codec=$3 out pull=()
  shift 3
  [[ $codec == */* ]] && pull=(--pull-compression "${codec#*/}")
  out=$(cli submit "$job" --workers "$n" --mode sync --compression "${codec%%/*}" "${pull[@]}" "$@" 2>&1) ||
    die "submit failed: $out"
  echo "$out" | grep -o 'job-[0-9]*' | head -1
}
# last_step LOG JOB -> the last step worker logged for JOB (-1: none yet).
last_step() {
  awk -v job="$2:" '$4 == job && /BENCH ONLY/ && /end_unix_us/ {for (i = 1; i < NF; i++) if ($i == "step") s = $(i + 1)} END {print (s == "" ? -1 : s)}' "$1"
}
step_reached() { (($(last_step "$1" "$2") >= $3)); }

# --- One point of the N x S table -------------------------------------------------
RESULTS="$RUN_DIR/results.tsv"
# measure N S CODEC TLS RATE PIN K: prints one row and appends it to RESULTS.
measure() {
  local n=$1 s=$2 codec=$3 tls=$4 rate=$5 pin=$6 k=$7 job step0 step1 bytes0 bytes1 segs0 segs1 \
    waits0 waits1
  net_up "$n" "$s" "$rate"
  start_cluster "$n" "$s" "$tls" "$FIXED_MS" "$pin"
  job=$(submit "$JOB" "$n" "$codec")
  local w1="$STATE/worker1.log" timeout_s=$((60 + 10 * (WARM + k) * (n / s + 1)))
  # The counters are read as soon as the step's line appears (polled every
  # 10 ms) at both ends of the window, so that the traffic of the next step
  # counted at each end cancels out on average.
  POLL_S=0.01 wait_for "step $WARM of $job" "$timeout_s" step_reached "$w1" "$job" "$WARM"
  step0=$(last_step "$w1" "$job")
  bytes0=$(link_bytes)
  segs0=$(tcp_segs)
  waits0=$(barrier_waits)
  POLL_S=0.01 wait_for "step $((step0 + k)) of $job" "$timeout_s" step_reached "$w1" "$job" $((step0 + k))
  bytes1=$(link_bytes)
  segs1=$(tcp_segs)
  step1=$(last_step "$w1" "$job")
  waits1=$(barrier_waits)  # After step1: it takes a few hundred ms.
  if ((${TRACE_S:-0} > 0)); then
    # After the window, so that the capture's CPU does not weigh on its row.
    ip netns exec "${WORKER_NS[0]}" python3 "$ROOT/bench/link_trace.py" capture eth0 "$TRACE_S" \
      "$STATE/trace-w1.txt" ||
      die "TRACE_S: the packet capture in ${WORKER_NS[0]} failed (it needs root and AF_PACKET sockets)"
  fi
  cli cancel "$job" >/dev/null 2>&1 || true
  stop_processes
  python3 - "$w1" "$job" "$step0" "$step1" "$bytes0" "$bytes1" "$(rate_bits "$rate"),$(rate_bits "${SERVER_RATE:-$rate}")" \
    "$n" "$s" "$codec" "$tls" "$rate" "$pin" "$FIXED_MS" "$segs0" "$segs1" "$waits0" "$waits1" <<'PY' | tee -a "$RESULTS"
import statistics, sys
log, job, s0, s1, b0, b1, bits, n, s, codec, tls, rate, pin, fixed, g0, g1, w0, w1 = sys.argv[1:]
(ws0, wc0), (ws1, wc1) = (w.split() for w in (w0, w1))
barrier_wait_ms = 1e3 * (float(ws1) - float(ws0)) / max(1, int(wc1) - int(wc0))
(o0, r0, t0), (o1, r1, t1) = map(int, g0.split()), map(int, g1.split())
retrans = (r1 - r0) / max(1, o1 - o0)
s0, s1, fixed = int(s0), int(s1), int(fixed)
worker_bits, server_bits = map(int, bits.split(","))
ends = {}
for line in open(log):
    f = line.split()
    if len(f) > 4 and f[3] == job + ":" and "end_unix_us" in line:
        d = dict(zip(f[::1], f[1::1]))
        ends[int(d["step"])] = int(d["end_unix_us"])
steps = [t for t in range(s0, s1 + 1) if t in ends]
gaps = [(ends[b] - ends[a]) / 1e3 for a, b in zip(steps, steps[1:]) if b == a + 1]
step_ms = statistics.median(gaps)
mean_ms = (ends[steps[-1]] - ends[steps[0]]) / 1e3 / (steps[-1] - steps[0])
def parse(x):
    v = x.split()
    return {v[i]: (int(v[i + 1]), int(v[i + 2])) for i in range(0, len(v), 3)}
p0, p1 = parse(b0), parse(b1)
# Bytes per step each host sent (up) and received (down).
up = {h: (p1[h][0] - p0[h][0]) / (s1 - s0) for h in p1}
down = {h: (p1[h][1] - p0[h][1]) / (s1 - s0) for h in p1}
# Host h's link time for b bytes (servers' links may be faster: SERVER_RATE).
ms = lambda h, b: b * 8 / (server_bits if h.startswith("s") else worker_bits) * 1e3
# Serial: a link's two directions one after the other (push, then pull).
serial_ms = fixed + max(ms(h, up[h] + down[h]) for h in p1)
# Duplex: each direction on its own (full-duplex links): no schedule beats it.
duplex_ms = fixed + max(ms(h, max(up[h], down[h])) for h in p1)
mean = lambda d, k: statistics.mean(v for h, v in d.items() if h.startswith(k)) / 1e6
print("\t".join(str(x) for x in [
    f"bench_only_fixed_compute_ms={fixed}", n, s, codec, "tls" if tls == "1" else "plain", rate,
    "pinned" if pin == "1" else "shared", s1 - s0, f"{step_ms:.1f}", f"{mean_ms:.1f}",
    f"{mean(up, 'w'):.2f}", f"{mean(down, 'w'):.2f}", f"{mean(down, 's'):.2f}",
    f"{mean(up, 's'):.2f}", f"{serial_ms:.1f}", f"{step_ms / serial_ms:.2f}",
    f"{duplex_ms:.1f}", f"{step_ms / duplex_ms:.2f}", f"{100 * retrans:.2f}",
    f"{(t1 - t0) / (s1 - s0):.2f}", f"{barrier_wait_ms:.1f}",
    f"{(int(wc1) - int(wc0)) / (s1 - s0):.1f}"]))
PY
  if ((${TRACE_S:-0} > 0)); then
    # Every step in the cluster's directory; the summary lines printed.
    python3 "$ROOT/bench/link_trace.py" report "$STATE/trace-w1.txt" --port "$PORT" \
      --rate-bits "$(rate_bits "$rate")" --idle-ms $((FIXED_MS / 2 > 5 ? FIXED_MS / 2 : 5)) |
      sed "s/^/bench_only_fixed_compute_ms=$FIXED_MS N=$n S=$s $codec worker 1: /" >"$STATE/trace-w1.report"
    grep -v ' link_trace: step ' "$STATE/trace-w1.report" | tee -a "$RUN_DIR/notes.txt"
  fi
}
HEADER="N\tS\tcodec\ttransport\trate\tcores\tsteps\tstep_ms_median\tstep_ms_mean\tworker_up_MB\tworker_down_MB\tserver_in_MB\tserver_out_MB\tserial_bound_ms\tstep/serial\tduplex_bound_ms\tstep/duplex\tretrans_%\trto_per_step\tbarrier_wait_ms\tbarriers_per_step"
header() { printf 'bench_only_fixed_compute_ms=%s\t%b\n' "$FIXED_MS" "$HEADER" | tee -a "$RESULTS"; }
note() { echo "bench_only_fixed_compute_ms=$FIXED_MS $*" | tee -a "$RUN_DIR/notes.txt"; }
when() { echo "$(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, netem $HAVE_NETEM, tcp $TCP_CC"; }
# steps_for N S RATE: steps to measure so that the window lasts about WINDOW_S.
steps_for() {
  python3 -c "
import math
n, s, bits = $1, $2, $(rate_bits "$3")
est_ms = $FIXED_MS + 2 * 8.43e6 * 8 / bits * 1e3 * max(1, n / s)
print(max(6, min(40, math.ceil($WINDOW_S * 1e3 / est_ms))))"
}
# efficiency: per (S, codec, transport, rate), step(N=1) / step(N) from RESULTS.
efficiency() {
  python3 - "$RESULTS" "$FIXED_MS" <<'PY'
import sys
rows = [r for r in (l.rstrip("\n").split("\t") for l in open(sys.argv[1])) if len(r) > 16 and r[1].isdigit()]
base = {}
for r in rows:
    if r[1] == "1": base[(r[2], r[3], r[4], r[5], r[6])] = float(r[8])
print(f"bench_only_fixed_compute_ms={sys.argv[2]}\tN\tS\tcodec\tstep_ms\tscaling_efficiency(step_N1/step_N)")
for r in rows:
    key = (r[2], r[3], r[4], r[5], r[6])
    if key in base:
        print(f"bench_only_fixed_compute_ms={sys.argv[2]}\t{r[1]}\t{r[2]}\t{r[3]}\t{r[8]}\t{base[key] / float(r[8]):.2f}")
PY
}

# --- Modes --------------------------------------------------------------------------
if [[ $WHAT == smoke ]]; then
  note "== smoke: N=2 S=2 none, $RATE links, $(when)"
  WARM=2
  header
  measure 2 2 none 0 "$RATE" 0 8
  efficiency
  note "smoke: done; results in $RUN_DIR"
fi

if [[ $WHAT == sweep || $WHAT == all ]]; then
  note "== sweep: sync, $(basename "$JOB"), $RATE links (servers ${SERVER_RATE:-$RATE}; +${DELAY_MS} ms netem where available), fixed compute ${FIXED_MS} ms, $(when)"
  header
  for codec in ${CODECS:-none onebit}; do
    for s in ${SS_LIST:-1 2 4}; do
      for n in ${NS_LIST:-1 2 4 8}; do
        measure "$n" "$s" "$codec" 0 "$RATE" 0 "$(steps_for "$n" "$s" "$RATE")"
      done
    done
  done
  efficiency | tee -a "$RUN_DIR/efficiency.tsv"
fi

if [[ $WHAT == tls || $WHAT == all ]]; then
  if [[ -n ${CORES_PER_HOST:-} ]]; then
    placement="$CORES_PER_HOST cores per host (servers from core 0, then workers)"
  else
    placement="servers on core 0, workers on core 1"
  fi
  note "== tls: TLS 1.3 + mTLS + tokens vs plaintext, $placement, $(when)"
  header
  for rate in ${TLS_RATES:-10gbit 1gbit}; do
    for ns in ${TLS_SIZES:-1:1 2:2}; do
      IFS=: read -r n s <<<"$ns"
      for tls in 0 1 0 1; do  # Interleaved, twice.
        measure "$n" "$s" none "$tls" "$rate" 1 "$(steps_for "$n" "$s" "$rate")"
      done
    done
  done
  # What TLS costs at each point: 1 - plaintext step / TLS step (throughput).
  python3 - "$RESULTS" "$FIXED_MS" <<'PY' | tee -a "$RUN_DIR/tls-cost.tsv"
import statistics, sys
steps = {}
for r in (l.rstrip("\n").split("\t") for l in open(sys.argv[1])):
    if len(r) > 16 and r[1].isdigit():
        steps.setdefault((r[5], r[1], r[2]), {}).setdefault(r[4], []).append(float(r[8]))
print(f"bench_only_fixed_compute_ms={sys.argv[2]}\trate\tN\tS\tplain_step_ms\ttls_step_ms\ttls_cost")
for (rate, n, s), by in steps.items():
    if "plain" in by and "tls" in by:
        plain, tls = statistics.median(by["plain"]), statistics.median(by["tls"])
        print(f"bench_only_fixed_compute_ms={sys.argv[2]}\t{rate}\t{n}\t{s}\t{plain:.1f}\t{tls:.1f}\t{100 * (1 - plain / tls):.1f}%")
PY
fi

if [[ $WHAT == fmnist || $WHAT == all ]]; then
  FMNIST_EPOCHS=${FMNIST_EPOCHS:-3}
  TTA_JOB="$RUN_DIR/fmnist-constant-lr.json"
  python3 - "$ROOT/examples/fashion-mnist.json" "$TTA_JOB" <<'PY'
import json, os, sys
job = json.load(open(sys.argv[1]))
job["optimizer"].pop("schedule", None)
job["model_file"] = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), job["model_file"])
json.dump(job, open(sys.argv[2], "w"), indent=1)
PY
  FIXED_MS=0
  note "== fmnist: examples/fashion-mnist.json, constant lr 0.01 momentum 0.9, sync, 2 workers (2x64), 2 shards, 1gbit links, $FMNIST_EPOCHS epochs, real training, $(when)"
  note "codec	epoch	seconds_since_submit	test_accuracy	vs_none_points"
  net_up 2 2 1gbit
  declare -A NONE_ACC
  for codec in ${FMNIST_CODECS:-none fp16 bf16 topk:0.01 onebit}; do
    start_cluster 2 2 0 0 0 --checkpoint-interval-s 0 --keep-checkpoints 100
    t0=$(date +%s.%N)
    out=$(timeout $((FMNIST_EPOCHS * 600)) ip netns exec "${SERVER_NS[0]}" "$BIN/pstrain" \
      --server "$SERVER" --timeout-ms 30000 submit "$TTA_JOB" --workers 2 --mode sync \
      --epochs "$FMNIST_EPOCHS" --compression "$codec" --watch --json 2>&1 | tail -1) || true
    t1=$(date +%s.%N)
    stop_processes
    final=$(python3 -c "import json,sys; print(json.loads(sys.argv[1]).get('test', {}).get('accuracy', 'nan'))" "$out" 2>/dev/null || echo nan)
    tta="not reached"
    e=0
    for ckpt in $(ls "$STATE"/state0/jobs/*/checkpoints/ckpt-*.ckpt 2>/dev/null | sort); do
      e=$((e + 1))
      at=$(python3 -c "import os,sys; print(round(os.stat(sys.argv[1]).st_mtime - $t0, 1))" "$ckpt")
      acc=$("$BIN/pstrain-worker" --evaluate "$ckpt" --device cpu 2>/dev/null | tail -1 |
        python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['test_accuracy'], 4))")
      [[ $codec == none ]] && NONE_ACC[$e]=$acc
      delta=$(python3 -c "b='${NONE_ACC[$e]:-}'; print(f'{100 * ($acc - float(b)):+.2f}' if b else '')")
      note "$codec	ckpt $e	$at	$acc	$delta"
      if [[ $tta == "not reached" ]] && python3 -c "import sys; sys.exit(not $acc >= 0.90)"; then
        tta="${at} s (checkpoint $e)"
      fi
    done
    note "$codec: final test_accuracy $final, wall $(python3 -c "print(round($t1 - $t0, 1))") s, time to 0.90: $tta"
  done
fi
if [[ $WHAT == torch ]]; then
  FIXED_MS=0
  TORCH_STEPS=${TORCH_STEPS:-12} TORCH_WARM=${TORCH_WARM:-3} TORCH_BATCH=${TORCH_BATCH:-16}
  PY=${TORCH_PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}  # Debian's: its torch
  TORCH_ENV=(OMP_NUM_THREADS=1 PYTHONPATH="${BIN%/bin}/python")
  # torch_point N SIDE CODEC ROUND S: one measurement (S servers for
  # pstrain), one line of $RESULTS.
  torch_point() {
    local n=$1 side=$2 codec=$3 round=$4 s=$5 i job pids=() p deadline shards="" server_pids=()
    local server_ticks=0
    stop_processes
    STATE=$(mktemp -d "$RUN_DIR/torch.XXXXXX")
    local worker=("$PY" "$ROOT/bench/torch_ddp_bench.py" --as-worker --side "$side"
      --model resnet18 --workers "$n" --steps "$TORCH_STEPS" --warmup "$TORCH_WARM"
      --batch "$TORCH_BATCH" --threads-per-worker 1 --out "$STATE/fig")
    if [[ $side == ddp ]]; then
      for ((i = 0; i < n; i++)); do
        ip netns exec "${WORKER_NS[$i]}" env "${TORCH_ENV[@]}" RANK="$i" \
          MASTER_ADDR="${WORKER_IP[0]}" MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 \
          "${worker[@]}" --ddp-hook "$codec" >"$STATE/w$i.log" 2>&1 &
        PIDS+=($!) pids+=($!)
      done
    else
      SERVER="${SERVER_IP[0]}:$PORT"
      for ((i = 0; i < s; i++)); do shards+="${shards:+,}${SERVER_IP[$i]}:$PORT"; done
      for ((i = 0; i < s; i++)); do
        ip netns exec "${SERVER_NS[$i]}" "$BIN/pstrain-server" --listen "${SERVER_IP[$i]}:$PORT" \
          --shards "$shards" --shard-index "$i" --insecure --metrics-port "$METRICS_PORT" \
          --state-dir "$STATE/state$i" ${SERVER_ARGS:-} >"$STATE/server$i.log" 2>&1 &
        PIDS+=($!) server_pids+=($!)
      done
      for ((i = 0; i < s; i++)); do
        wait_for "server $i listening" 30 port_open "${SERVER_NS[$i]}" "${SERVER_IP[$i]}"
      done
      job=$(ip netns exec "${SERVER_NS[0]}" env "${TORCH_ENV[@]}" "$PY" \
        "$ROOT/bench/torch_ddp_bench.py" --submit "$SERVER" --model resnet18 --workers "$n" \
        --batch "$TORCH_BATCH" --compression "$codec") || die "submit failed"
      for ((i = 0; i < n; i++)); do
        ip netns exec "${WORKER_NS[$i]}" env "${TORCH_ENV[@]}" PSTRAIN_SERVER="$SERVER" \
          PSTRAIN_JOB="$job" PSTRAIN_MODE=sync "${worker[@]}" >"$STATE/w$i.log" 2>&1 &
        PIDS+=($!) pids+=($!)
      done
    fi
    deadline=$(($(date +%s) + ${TORCH_TIMEOUT_S:-900}))
    for p in "${pids[@]}"; do
      while kill -0 "$p" 2>/dev/null; do
        (($(date +%s) < deadline)) || die "$side $codec N=$n did not finish (logs: $STATE)"
        sleep 0.2
      done
      wait "$p" || die "$side $codec N=$n: a worker failed: $(tail -3 "$STATE"/w*.log)"
    done
    # The servers' CPU (user + system, every thread) over the whole job.
    for p in "${server_pids[@]}"; do
      server_ticks=$((server_ticks + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
    done
    stop_processes
    python3 - "$STATE" "$side" "$n" "$codec" "$round" "$s" "$server_ticks" "$(getconf CLK_TCK)" \
      "$TORCH_STEPS" <<'PY' | tee -a "$RESULTS"
import glob, json, statistics, sys
state, side, n, codec, rnd, servers, ticks, hz, steps = sys.argv[1:]
figs = [json.load(open(f)) for f in glob.glob(f"{state}/fig.{side}.*")]
step = statistics.median(f["step_ms"] for f in figs)
rate = sum(f["samples_per_sec"] for f in figs)
worker_cpu = statistics.mean(f.get("cpu_ms_per_step", 0.0) for f in figs)
server_cpu = 1000 * int(ticks) / int(hz) / int(steps)
label = side if side == "ddp" else f"{side}-S{servers}"
print(f"bench_only_fixed_compute_ms=0\t{n}\t{label}\t{codec}\t{rnd}\t{step:.1f}\t{rate:.2f}"
      f"\t{worker_cpu:.0f}\t{server_cpu:.0f}")
PY
  }
  note "== torch: ResNet-18 (torchvision, synthetic 3x64x64, batch $TORCH_BATCH per worker, 1 thread each), sync SGD, pstrain.torch vs DDP (gloo), $RATE links (+${DELAY_MS} ms netem where available), servers per pstrain point: ${TORCH_SERVERS:-1 N}, $("$PY" -c 'import torch; print("torch", torch.__version__)'), $(when)"
  printf 'bench_only_fixed_compute_ms=0\tN\tside\tcodec\tround\tstep_ms\tsamples_per_s\tworker_cpu_ms_per_step\tservers_cpu_ms_per_step\n' |
    tee -a "$RESULTS"
  for n in ${TORCH_NS:-2 4}; do
    net_up "$n" "$n" "$RATE"
    points=()  # SIDE:CODEC@S
    for sc in ${TORCH_SIDES:-ddp:none ddp:fp16 pstrain:none pstrain:fp16/fp16 pstrain:topk:0.01 pstrain:topk:0.01/fp16}; do
      if [[ ${sc%%:*} == ddp ]]; then
        points+=("$sc@0")
      else
        for s in ${TORCH_SERVERS:-1 N}; do points+=("$sc@${s/N/$n}"); done
      fi
    done
    for ((round = 1; round <= ${TORCH_ROUNDS:-2}; round++)); do
      order=("${points[@]}")
      if ((round % 2 == 0)); then
        order=()
        for ((i = ${#points[@]} - 1; i >= 0; i--)); do order+=("${points[$i]}"); done
      fi
      for p in "${order[@]}"; do
        sc=${p%@*}
        torch_point "$n" "${sc%%:*}" "${sc#*:}" "$round" "${p##*@}"
      done
    done
  done
  # Per N and side: the median step over the rounds, and DDP's best against pstrain's.
  python3 - "$RESULTS" <<'PY' | tee -a "$RUN_DIR/torch-summary.tsv"
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
steps = {}
for r in rows:
    if len(r) >= 7 and r[1].isdigit():
        steps.setdefault(r[1], {}).setdefault(f"{r[2]}:{r[3]}", []).append(float(r[5]))
print("bench_only_fixed_compute_ms=0\tN\tside\tstep_ms_median\tDDP_best_step/step")
for n, by in steps.items():
    ddp = [statistics.median(v) for k, v in by.items() if k.startswith("ddp:")]
    for k, v in by.items():
        m = statistics.median(v)
        ratio = f"{min(ddp) / m:.2f}x" if ddp else "(no DDP point)"
        print(f"bench_only_fixed_compute_ms=0\t{n}\t{k}\t{m:.1f}\t{ratio}")
PY
fi
note "results in $RUN_DIR"
