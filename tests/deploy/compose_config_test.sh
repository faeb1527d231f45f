#!/usr/bin/env bash
# `docker-compose config` on deploy/docker/compose.yaml (Debian's
# docker-compose; no Docker engine is needed to validate), and the parts the
# deployment relies on: a server, two workers reserving an NVIDIA GPU, and
# Prometheus with the config, rules and consoles mounted.
# Usage: compose_config_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
COMPOSE=$(find_tool docker-compose "$2")
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$COMPOSE" -f "$SRC/deploy/docker/compose.yaml" config >"$OUT"
python3 - "$OUT" <<'PY' || fail "compose.yaml lacks a required piece"
import sys
text = open(sys.argv[1]).read()
need = ["pstrain-server:", "pstrain-worker-1:", "pstrain-worker-2:", "prometheus:",
        "driver: nvidia", "/etc/prometheus/prometheus.yml", "/etc/prometheus/rules.yml",
        "/etc/prometheus/consoles", "condition: service_healthy"]
missing = [n for n in need if n not in text]
print("missing:", missing) if missing else None
sys.exit(1 if missing or text.count("driver: nvidia") != 2 else 0)
PY
echo "PASS: docker-compose config"
