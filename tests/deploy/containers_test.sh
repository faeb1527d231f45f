#!/usr/bin/env bash
# The images and the compose stack, built and run on this machine.
#
# Usage: containers_test.sh SOURCE_DIR WORK_DIR
#
#   1. engine:  uses the running Docker engine, or starts a private dockerd
#               (--bridge=none --iptables=false --ip-forward=false, its own
#               data-root, exec-root, socket and pidfile under WORK_DIR and
#               /tmp) and stops it at the end. Exits 77 (ctest: skipped) with
#               the reason when no engine can run here.
#   2. images:  the local Debian base (deploy/docker/base-image.sh), then
#               pstrain-server and the CPU pstrain-worker (the compile runs
#               once: the two Dockerfiles share their build stage) and a
#               Prometheus stand-in built from Debian's package
#               (tests/deploy/Dockerfile.prometheus), all with --network host.
#               Each must run as uid 10001 (nobody for Prometheus) and carry
#               a HEALTHCHECK.
#   3. stack:   deploy/local/make-certs.sh, then deploy/docker/compose.yaml
#               up (server, two CPU workers, Prometheus) with TLS, mTLS and
#               tokens from compose secrets, on free 127.0.0.1 ports; a
#               plaintext client, plain-HTTP /metrics and HTTPS /metrics
#               without a client certificate must be refused;
#               every container must use
#               the host network, the project must own no Docker network, the
#               daemons' ports must be bound to 127.0.0.1 only, and every
#               container must turn healthy.
#   4. job:     the `pstrain` CLI in a one-off container submits
#               examples/fashion-mnist.json for one epoch on both workers and
#               watches it; it must reach SUCCEEDED.
#   5. scrape:  Prometheus' /api/v1/targets must show the server and both
#               workers up (it scrapes with its client certificate).
# Every wait has a deadline. On exit it removes the compose project
# (containers, volumes), the images it built (unless
# PSTRAIN_CONTAINERS_KEEP_IMAGES=1) and, if it started one, its dockerd.
#
# Environment: PSTRAIN_CONTAINERS_OWN_DOCKERD=1 starts a private dockerd even
# when an engine is running (the path CI takes on a fresh machine);
# PSTRAIN_CONTAINERS_BUILD_JOBS (default 2) compile jobs inside the build.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$(cd "$1" && pwd)
WORK=$2
SKIP=77
skip() { echo "SKIP: $*"; exit "$SKIP"; }
T0=$SECONDS
TIMES=()
phase() {  # phase NAME: closes the previous phase's timer, opens NAME's
  local now=$SECONDS
  [[ -n "${PHASE:-}" ]] && TIMES+=("$PHASE $((now - PHASE_T0))s")
  PHASE=$1
  PHASE_T0=$now
  echo "== $PHASE ($((now - T0))s)"
}

# ---- tools --------------------------------------------------------------------
for tool in curl python3 ss; do
  command -v "$tool" >/dev/null || fail "$tool is not installed"
done
COMPOSE=$(find_tool docker-compose "")
[[ -d /usr/share/datasets/fashion-mnist ]] ||
  fail "no Fashion-MNIST in /usr/share/datasets (install-deps.sh installs dataset-fashion-mnist)"
command -v mmdebstrap >/dev/null ||
  fail "mmdebstrap is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
CLIENTS=()
for c in /usr/bin/docker "$(command -v docker || true)"; do
  [[ -n "$c" && -x "$c" ]] && CLIENTS+=("$c")
done
((${#CLIENTS[@]})) || skip "no Docker client (install Debian's docker.io)"

rm -rf "$WORK"
mkdir -p "$WORK/logs"
PROJECT=pstrain-ctest-$$
TAG=ctest-$$
BASE=pstrain-ctest/debian:bookworm-slim-$TAG
SERVER_IMAGE=pstrain-ctest/server:$TAG
WORKER_IMAGE=pstrain-ctest/worker:$TAG
BUILD_IMAGE=pstrain-ctest/build:$TAG
PROM_FETCH_IMAGE=pstrain-ctest/prometheus-fetch:$TAG
PROM_IMAGE=pstrain-ctest/prometheus:$TAG
BUILT=()
DOCKERD_PID=""
EXEC_ROOT=""
COMPOSE_UP=0

dump_logs() {
  ((COMPOSE_UP)) && "$COMPOSE" -p "$PROJECT" -f "$SRC/deploy/docker/compose.yaml" logs --tail=30 >&2 || true
}
cleanup() {
  local rc=$?
  set +e
  if ((COMPOSE_UP)); then
    timeout 120 "$COMPOSE" -p "$PROJECT" -f "$SRC/deploy/docker/compose.yaml" \
      down --volumes --remove-orphans --timeout 10 >"$WORK/logs/down.log" 2>&1
    # One-off containers of `run` that a timeout left behind.
    ids=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
    [[ -n "$ids" ]] && docker rm -f $ids >/dev/null
  fi
  if [[ "${PSTRAIN_CONTAINERS_KEEP_IMAGES:-0}" != 1 && -z "$DOCKERD_PID" ]] && ((${#BUILT[@]})); then
    for ((i = ${#BUILT[@]} - 1; i >= 0; i--)); do  # children before parents
      docker rmi "${BUILT[i]}" >/dev/null 2>&1 || echo "could not remove image ${BUILT[i]}" >&2
    done
  fi
  if [[ -n "$DOCKERD_PID" ]]; then
    kill -TERM "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 300); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && { echo "dockerd did not stop: SIGKILL" >&2; kill -KILL "$DOCKERD_PID"; }
    # Anything the daemon left mounted under its roots, then the roots.
    findmnt -rn -o TARGET | grep -E "^($WORK/docker|$EXEC_ROOT)" | sort -r | xargs -r umount -l
    rm -rf --one-file-system "$WORK/docker" "$EXEC_ROOT"
  fi
  echo "phases: ${TIMES[*]:-none}; total $((SECONDS - T0))s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # ctest's timeout, Ctrl-C: clean up all the same

# ---- 1. engine ----------------------------------------------------------------
phase engine
pick_client() {  # the first client that talks to the engine at DOCKER_HOST
  for c in "${CLIENTS[@]}"; do
    "$c" version --format '{{.Server.Version}}' >/dev/null 2>&1 && { echo "$c"; return 0; }
  done
  return 1
}
CLIENT=""
if [[ "${PSTRAIN_CONTAINERS_OWN_DOCKERD:-0}" != 1 ]]; then
  CLIENT=$(pick_client) || CLIENT=""
fi
if [[ -z "$CLIENT" ]]; then
  command -v dockerd >/dev/null || skip "no Docker engine is running and dockerd is not installed"
  [[ $(id -u) == 0 ]] || skip "no Docker engine is running and starting dockerd needs root"
  # Short paths: the daemon's unix sockets live under the exec-root.
  EXEC_ROOT=$(mktemp -d /tmp/pstrain-dockerd.XXXXXX)
  mkdir -p "$WORK/docker"
  export DOCKER_HOST=unix://$EXEC_ROOT/docker.sock
  dockerd --host="$DOCKER_HOST" --data-root="$WORK/docker" --exec-root="$EXEC_ROOT/exec" \
    --pidfile="$EXEC_ROOT/dockerd.pid" --bridge=none --iptables=false --ip6tables=false \
    --ip-forward=false --ip-masq=false --containerd-namespace=pstrain-ctest \
    --containerd-plugins-namespace=pstrain-ctest-plugins \
    >"$WORK/logs/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 600); do
    CLIENT=$(pick_client) && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -z "$CLIENT" ]]; then
    tail -5 "$WORK/logs/dockerd.log" >&2
    skip "no Docker engine can run here: dockerd exited or did not answer within 60s (its log above)"
  fi
  echo "started dockerd (pid $DOCKERD_PID) at $DOCKER_HOST"
fi
docker() { "$CLIENT" "$@"; }
export DOCKER=$CLIENT DOCKER_BUILDKIT=0  # the classic builder: both clients have it
echo "client $CLIENT, engine $(docker version --format '{{.Server.Version}}')"
# An engine that answers may still be unable to unpack an image layer: a
# dockerd inside a chroot (fresh-machine's root, for one) cannot remount / and
# fails every import and pull. A one-file image tells before any real work.
PROBE_IMAGE=pstrain-ctest/probe:$TAG
mkdir -p "$WORK/probe" && echo probe >"$WORK/probe/probe.txt"
if ! tar -C "$WORK/probe" -cf - probe.txt | docker import - "$PROBE_IMAGE" >"$WORK/logs/probe.log" 2>&1; then
  cat "$WORK/logs/probe.log" >&2
  skip "this Docker engine cannot unpack image layers here (a one-file docker import failed: $(tail -1 "$WORK/logs/probe.log"))"
fi
docker rmi "$PROBE_IMAGE" >/dev/null 2>&1 || true

# ---- 2. images ----------------------------------------------------------------
phase base-image
BUILT+=("$BASE")
timeout 600 "$SRC/deploy/docker/base-image.sh" "$BASE" >"$WORK/logs/base-image.log" 2>&1 ||
  { tail -20 "$WORK/logs/base-image.log" >&2; fail "deploy/docker/base-image.sh failed"; }

build() {  # build TIMEOUT_S LOG DOCKER_BUILD_ARGS...: fails with the log's tail
  local limit=$1 log=$WORK/logs/$2.log
  shift 2
  timeout "$limit" "$CLIENT" build --force-rm --network host --build-arg "BASE_IMAGE=$BASE" "$@" >"$log" 2>&1 ||
    { tail -30 "$log" >&2; fail "docker build $* failed or timed out (${limit}s; $log)"; }
}
phase build-server
JOBS=${PSTRAIN_CONTAINERS_BUILD_JOBS:-2}
# Build stages get tags of their own, so that removing the tagged images
# (children first) leaves nothing of the run behind.
BUILT+=("$BUILD_IMAGE" "$SERVER_IMAGE" "$WORKER_IMAGE" "$PROM_FETCH_IMAGE" "$PROM_IMAGE")
build 3000 build-stage --build-arg "BUILD_JOBS=$JOBS" --target build -t "$BUILD_IMAGE" \
  -f "$SRC/deploy/docker/Dockerfile.server" "$SRC"
build 900 server --build-arg "BUILD_JOBS=$JOBS" -t "$SERVER_IMAGE" \
  -f "$SRC/deploy/docker/Dockerfile.server" "$SRC"
phase build-worker
build 900 worker --build-arg "BUILD_JOBS=$JOBS" -t "$WORKER_IMAGE" \
  -f "$SRC/deploy/docker/Dockerfile.worker" "$SRC"
awk '/^Step .*RUN cmake /{getline; print; exit}' "$WORK/logs/worker.log" | grep -q 'Using cache' ||
  fail "the worker image compiled pstrain again: its build stage differs from the server's"
phase build-prometheus
build 900 prometheus-fetch --target fetch -t "$PROM_FETCH_IMAGE" \
  -f "$SRC/tests/deploy/Dockerfile.prometheus" "$SRC/tests/deploy"
build 900 prometheus -t "$PROM_IMAGE" -f "$SRC/tests/deploy/Dockerfile.prometheus" "$SRC/tests/deploy"

for image in "$SERVER_IMAGE" "$WORKER_IMAGE"; do
  user=$(docker image inspect -f '{{.Config.User}}' "$image")
  [[ "$user" == 10001:10001 ]] || fail "$image runs as '$user', not 10001:10001"
done
for image in "$SERVER_IMAGE" "$WORKER_IMAGE" "$PROM_IMAGE"; do
  [[ -n "$(docker image inspect -f '{{if .Config.Healthcheck}}yes{{end}}' "$image")" ]] ||
    fail "$image has no HEALTHCHECK"
done
for spec in "$SERVER_IMAGE:pstrain-server" "$SERVER_IMAGE:pstrain" "$WORKER_IMAGE:pstrain-worker" \
  "$WORKER_IMAGE:pstrain"; do
  image=${spec%:*} binary=${spec##*:}
  missing=$(docker run --rm --network none --entrypoint ldd "$image" "/usr/local/bin/$binary" |
    grep 'not found' || true)
  [[ -z "$missing" ]] || fail "$binary in $image lacks libraries: $missing"
done
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep "$TAG" | sed 's/^/image: /'

# ---- 3. stack -----------------------------------------------------------------
phase stack
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
export PSTRAIN_GRPC_PORT=$(free_port) PSTRAIN_SERVER_METRICS_PORT=$(free_port)
export PSTRAIN_WORKER1_METRICS_PORT=$(free_port) PSTRAIN_WORKER2_METRICS_PORT=$(free_port)
export PSTRAIN_WORKER1_HEALTH_PORT=$(free_port) PSTRAIN_WORKER2_HEALTH_PORT=$(free_port)
export PSTRAIN_SERVER_HEALTH_PORT=$(free_port)
# The stack runs as users run it: TLS, mTLS and tokens from compose secrets,
# made as the README says, owned by the images' user.
export PSTRAIN_CERTS=$WORK/certs
"$SRC/deploy/local/make-certs.sh" "$PSTRAIN_CERTS" --owner 10001 >"$WORK/logs/certs.log" 2>&1 ||
  { cat "$WORK/logs/certs.log" >&2; fail "deploy/local/make-certs.sh failed"; }
export PSTRAIN_PROMETHEUS_PORT=$(free_port)
export PSTRAIN_SERVER_IMAGE=$SERVER_IMAGE PSTRAIN_WORKER_IMAGE=$WORKER_IMAGE
export PSTRAIN_PROMETHEUS_IMAGE=$PROM_IMAGE PSTRAIN_WORKER_THREADS=1
export PSTRAIN_PROMETHEUS_TARGETS=$WORK/targets
mkdir -p "$PSTRAIN_PROMETHEUS_TARGETS"
cat >"$PSTRAIN_PROMETHEUS_TARGETS/servers.json" <<EOF
[{"targets": ["127.0.0.1:$PSTRAIN_SERVER_METRICS_PORT"], "labels": {"role": "server", "shard": "0"}}]
EOF
cat >"$PSTRAIN_PROMETHEUS_TARGETS/workers.json" <<EOF
[{"targets": ["127.0.0.1:$PSTRAIN_WORKER1_METRICS_PORT", "127.0.0.1:$PSTRAIN_WORKER2_METRICS_PORT"],
  "labels": {"role": "worker"}}]
EOF
chmod -R a+rX "$WORK/targets"  # Prometheus runs as nobody.
compose() { "$COMPOSE" -p "$PROJECT" -f "$SRC/deploy/docker/compose.yaml" "$@"; }
COMPOSE_UP=1
timeout 300 "$COMPOSE" -p "$PROJECT" -f "$SRC/deploy/docker/compose.yaml" up -d --no-build \
  >"$WORK/logs/up.log" 2>&1 || { cat "$WORK/logs/up.log" >&2; dump_logs; fail "compose up failed"; }
SERVICES=(pstrain-server pstrain-worker-1 pstrain-worker-2 prometheus)
declare -A CID
for s in "${SERVICES[@]}"; do
  CID[$s]=$(compose ps -q "$s")
  [[ -n "${CID[$s]}" ]] || { dump_logs; fail "no container for $s"; }
  mode=$(docker inspect -f '{{.HostConfig.NetworkMode}}' "${CID[$s]}")
  [[ "$mode" == host ]] || fail "$s uses network '$mode', not the host's"
done
networks=$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")
[[ -z "$networks" ]] || fail "compose created Docker networks: $networks"

deadline=$((SECONDS + 180))
for s in "${SERVICES[@]}"; do
  while :; do
    health=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "${CID[$s]}")
    [[ "$health" == healthy ]] && break
    ((SECONDS < deadline)) || { dump_logs; fail "$s is '$health', not healthy, after 180s"; }
    sleep 2
  done
done
echo "all containers healthy"
# Every port the stack listens on is bound to 127.0.0.1 and nothing wider.
for port in "$PSTRAIN_GRPC_PORT" "$PSTRAIN_SERVER_METRICS_PORT" "$PSTRAIN_WORKER1_METRICS_PORT" \
  "$PSTRAIN_WORKER2_METRICS_PORT" "$PSTRAIN_WORKER1_HEALTH_PORT" "$PSTRAIN_WORKER2_HEALTH_PORT" \
  "$PSTRAIN_SERVER_HEALTH_PORT" "$PSTRAIN_PROMETHEUS_PORT"; do
  addrs=$(ss -Hltn "sport = :$port" | awk '{print $4}' | sort -u | tr '\n' ' ')
  [[ -n "$addrs" ]] || fail "nothing listens on port $port"
  # gRPC listens on an IPv6 socket bound to the v4-mapped 127.0.0.1.
  wide=$(tr ' ' '\n' <<<"$addrs" | grep -Ev "^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]):$port\$" | grep . || true)
  [[ -z "$wide" ]] || fail "port $port is bound to '$addrs', not 127.0.0.1 only"
done
echo "ports bound to 127.0.0.1 only"
# The secure defaults hold: the gRPC port refuses a plaintext client and a
# TLS client without a certificate, /metrics refuses plain HTTP and a TLS
# client without a certificate (Prometheus' certificate gets in: phase 5).
CLI=(docker run --rm --network host --entrypoint pstrain "$SERVER_IMAGE" --timeout-ms 3000
  --server "127.0.0.1:$PSTRAIN_GRPC_PORT")
if "${CLI[@]}" list >"$WORK/logs/plaintext.log" 2>&1; then
  fail "a plaintext client without a token listed the jobs"
fi
if curl -sf --max-time 5 "http://127.0.0.1:$PSTRAIN_SERVER_METRICS_PORT/metrics" >/dev/null; then
  fail "/metrics answered plain HTTP"
fi
for port in "$PSTRAIN_SERVER_METRICS_PORT" "$PSTRAIN_WORKER1_METRICS_PORT"; do
  if curl -sf --max-time 5 --cacert "$PSTRAIN_CERTS/ca.pem" \
    "https://127.0.0.1:$port/metrics" >/dev/null 2>&1; then
    fail "/metrics on port $port answered HTTPS without a client certificate"
  fi
done
echo "TLS and tokens on: plaintext gRPC, plain HTTP and /metrics without a client certificate refused"
for w in pstrain-worker-1 pstrain-worker-2; do
  deadline=$((SECONDS + 60))
  until docker logs "${CID[$w]}" 2>&1 | grep -q registered; do
    ((SECONDS < deadline)) || { dump_logs; fail "$w did not register within 60s"; }
    sleep 1
  done
done

# ---- 4. job -------------------------------------------------------------------
phase job
timeout 1200 "$COMPOSE" -p "$PROJECT" -f "$SRC/deploy/docker/compose.yaml" run --rm -T pstrain-cli \
  submit /examples/fashion-mnist.json --epochs 1 --workers 2 --watch --json \
  >"$WORK/logs/job.log" 2>&1 || { tail -20 "$WORK/logs/job.log" >&2; dump_logs; fail "the job did not succeed (exit $?)"; }
tail -1 "$WORK/logs/job.log"
python3 - "$WORK/logs/job.log" <<'EOF' || fail "the CLI's last line does not say SUCCEEDED"
import json, sys
status = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("job %s: %s, test accuracy %s" % (status.get("job_id"), status.get("state"),
                                        status.get("test", {}).get("accuracy")))
sys.exit(0 if status.get("state") == "JOB_STATE_SUCCEEDED" else 1)
EOF

# ---- 5. scrape ----------------------------------------------------------------
phase scrape
PROM=http://127.0.0.1:$PSTRAIN_PROMETHEUS_PORT
deadline=$((SECONDS + 90))
until curl -sf "$PROM/api/v1/targets" | python3 -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
up = sorted(t["scrapeUrl"] for t in targets
            if t["labels"]["job"].startswith("pstrain-") and t["health"] == "up")
print("pstrain targets up:", up)
sys.exit(0 if len(up) == 3 else 1)'; do
  ((SECONDS < deadline)) || fail "Prometheus does not scrape all three daemons after 90s"
  sleep 3
done
phase done
echo "PASS: images built, stack up on 127.0.0.1, job SUCCEEDED, Prometheus scrapes all three daemons"
