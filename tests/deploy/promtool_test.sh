#!/usr/bin/env bash
# promtool on deploy/prometheus/: the config (with its rule files) and the
# rules, the Kubernetes copy of both (deploy/k8s/prometheus.yaml), and the
# alerting rules' unit tests (rules_test.yml: each alert fires when it should
# and stays silent when it should not).
# Usage: promtool_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
PROMTOOL=$(find_tool promtool "$2")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# promtool wants the scrape jobs' client certificate and key to exist: check
# copies of the configs that name stand-ins for the files the containers
# mount (compose: /etc/prometheus/certs; Kubernetes: also
# /etc/prometheus/client).
mkdir -p "$WORK/certs" "$WORK/compose"
touch "$WORK/certs/ca.pem" "$WORK/certs/prometheus.pem" "$WORK/certs/prometheus-key.pem"
cp -r "$SRC/deploy/prometheus/prometheus.yml" "$SRC/deploy/prometheus/rules.yml" \
  "$SRC/deploy/prometheus/targets" "$WORK/compose/"
sed -i "s|/etc/prometheus/certs/|$WORK/certs/|" "$WORK/compose/prometheus.yml"
"$PROMTOOL" check config "$WORK/compose/prometheus.yml"
"$PROMTOOL" check rules "$SRC/deploy/prometheus/rules.yml"
"$PROMTOOL" test rules "$SRC/tests/deploy/rules_test.yml"

# The Kubernetes ConfigMap carries its own prometheus.yml and a copy of
# rules.yml: check the first and that the copy has not drifted.
python3 - "$SRC/deploy/k8s/prometheus.yaml" "$WORK" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
for key in ("prometheus.yml", "rules.yml"):
    m = re.search(r"^  %s: \|\n((?:    .*\n|\n)+)" % re.escape(key), text, re.M)
    if not m:
        sys.exit("no %s in %s" % (key, sys.argv[1]))
    body = "".join(l[4:] if l.startswith("    ") else l for l in m.group(1).splitlines(True))
    open("%s/%s" % (sys.argv[2], key), "w").write(body)
PY
sed -i -e 's|/etc/prometheus/rules.yml|rules.yml|' \
  -e "s|/etc/prometheus/certs/|$WORK/certs/|" -e "s|/etc/prometheus/client/|$WORK/certs/|" \
  "$WORK/prometheus.yml"
# Debian's promtool is built without Kubernetes service discovery: check the
# rest (globals, relabelling, rules) with the pod discovery block swapped for
# an equivalent-shaped file discovery block.
python3 - "$WORK/prometheus.yml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
new = re.sub(r"kubernetes_sd_configs:\n( +)- role: pod\n(?:\1  .*\n)+",
             lambda m: "file_sd_configs:\n%s- files: [targets.json]\n" % m.group(1), text)
if new == text:
    sys.exit("no kubernetes_sd_configs block found")
open(sys.argv[1], "w").write(new)
PY
"$PROMTOOL" check config "$WORK/prometheus.yml"
diff -u "$SRC/deploy/prometheus/rules.yml" "$WORK/rules.yml" ||
  fail "deploy/k8s/prometheus.yaml's rules.yml differs from deploy/prometheus/rules.yml"
echo "PASS: promtool"
