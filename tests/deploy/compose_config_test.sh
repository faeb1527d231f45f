#!/usr/bin/env bash
# `docker-compose config` on deploy/docker/compose.yaml, alone (the CPU stack)
# and with compose.gpu.yaml (GPU workers), with Debian's docker-compose (no
# Docker engine is needed to validate), and the parts the deployment relies
# on: a server, two workers and Prometheus (config, rules, consoles mounted),
# the CLI as a one-off service; every container on the host network with
# every address 127.0.0.1 (no bridge network, no published ports, no
# 0.0.0.0); CPU workers on the CPU image without GPUs, GPU workers on the
# CUDA image reserving one NVIDIA GPU each; TLS, mTLS and tokens on every
# daemon and the CLI, client certificates on every /metrics (Prometheus gets
# its own), each service mounting only its own secrets.
# tests/deploy/containers_test.sh runs the CPU stack for real.
# Usage: compose_config_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
COMPOSE=$(find_tool docker-compose "$2")
D=$SRC/deploy/docker
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$COMPOSE" --profile cli -f "$D/compose.yaml" config >"$OUT/cpu.yaml"
"$COMPOSE" --profile cli -f "$D/compose.yaml" -f "$D/compose.gpu.yaml" config >"$OUT/gpu.yaml"
python3 - "$OUT/cpu.yaml" "$OUT/gpu.yaml" <<'PY' || fail "compose files lack a required piece (above)"
import sys
try:
    import yaml
except ImportError:
    sys.exit("python3 has no yaml module (Debian: python3-yaml)")

problems = []
def need(cond, what):
    if not cond:
        problems.append(what)

for path, flavour in ((sys.argv[1], "cpu"), (sys.argv[2], "gpu")):
    services = yaml.safe_load(open(path))["services"]
    need(sorted(services) == ["prometheus", "pstrain-cli", "pstrain-server",
                              "pstrain-worker-1", "pstrain-worker-2"],
         "%s: services are %s" % (flavour, sorted(services)))
    text = open(path).read()
    need("0.0.0.0" not in text, "%s: an address other than 127.0.0.1 (0.0.0.0)" % flavour)
    for name, s in services.items():
        need(s.get("network_mode") == "host", "%s: %s is not on the host network" % (flavour, name))
        need("ports" not in s and "networks" not in s,
             "%s: %s publishes ports or joins a network" % (flavour, name))
        for arg in s.get("command", []):
            for flag in ("--listen=", "--metrics-host=", "--server=", "--web.listen-address="):
                if arg.startswith(flag):
                    need(arg[len(flag):].startswith("127.0.0.1"),
                         "%s: %s binds or dials %s" % (flavour, name, arg))
        if "build" in s:
            need(s["build"].get("network") == "host", "%s: %s builds off the host network" % (flavour, name))
    mounts = " ".join(services["prometheus"]["volumes"])
    for target in ("/etc/prometheus/prometheus.yml", "/etc/prometheus/rules.yml",
                   "/etc/prometheus/targets", "/etc/prometheus/consoles"):
        need(target in mounts, "%s: prometheus lacks %s" % (flavour, target))
    need(services["pstrain-cli"].get("profiles") == ["cli"], "%s: pstrain-cli is not a one-off (profile cli)" % flavour)
    for w in ("pstrain-worker-1", "pstrain-worker-2"):
        s = services[w]
        need(s["depends_on"]["pstrain-server"]["condition"] == "service_healthy",
             "%s: %s does not wait for a healthy server" % (flavour, w))
        need(any(v.endswith(":/usr/share/datasets:ro") for v in s["volumes"]),
             "%s: %s lacks the read-only datasets" % (flavour, w))
        gpus = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if flavour == "cpu":
            need(not gpus and "--device=cpu" in s["command"], "cpu: %s is not a CPU worker" % w)
            need(s["build"]["dockerfile"].endswith("Dockerfile.worker"), "cpu: %s image" % w)
        else:
            need(len(gpus) == 1 and gpus[0]["driver"] == "nvidia" and gpus[0]["count"] == 1,
                 "gpu: %s does not reserve one NVIDIA GPU" % w)
            need(s["build"]["dockerfile"].endswith("Dockerfile.worker-cuda") and
                 s["image"] != services["pstrain-server"]["image"], "gpu: %s image" % w)
            need("--device=auto" in s["command"], "gpu: %s does not pick its device" % w)
    # Safe by default: TLS, client certificates and tokens everywhere.
    server = services["pstrain-server"]["command"]
    for flag in ("--tls-cert=", "--tls-key=", "--tls-ca=", "--token-file="):
        need(any(a.startswith(flag) for a in server), "%s: the server lacks %s" % (flavour, flag))
    need("--require-client-cert" in server, "%s: the server does not require client certificates" % flavour)
    def secrets_of(name):
        return sorted(x["source"] for x in services[name].get("secrets", []))
    need(secrets_of("pstrain-server") == ["ca.pem", "server-key.pem", "server.pem", "tokens"],
         "%s: server secrets %s" % (flavour, secrets_of("pstrain-server")))
    for w in ("pstrain-worker-1", "pstrain-worker-2"):
        for flag in ("--tls-ca=", "--tls-cert=", "--tls-key=", "--token-file="):
            need(any(a.startswith(flag) for a in services[w]["command"]),
                 "%s: %s lacks %s" % (flavour, w, flag))
        need("--require-client-cert" in services[w]["command"],
             "%s: %s's /metrics does not require client certificates" % (flavour, w))
        need(secrets_of(w) == ["ca.pem", "worker-key.pem", "worker.pem", "worker.token"],
             "%s: %s secrets %s" % (flavour, w, secrets_of(w)))
    cli_env = services["pstrain-cli"].get("environment", {})
    need(all(k in cli_env for k in ("PSTRAIN_TLS_CA", "PSTRAIN_TLS_CERT", "PSTRAIN_TLS_KEY",
                                    "PSTRAIN_TOKEN_FILE")), "%s: the CLI lacks TLS or token" % flavour)
    need(secrets_of("prometheus") == ["ca.pem", "prometheus-key.pem", "prometheus.pem"],
         "%s: prometheus secrets %s" % (flavour, secrets_of("prometheus")))
for p in problems:
    print("missing:", p)
sys.exit(1 if problems else 0)
PY
echo "PASS: docker-compose config (CPU stack, GPU override)"
