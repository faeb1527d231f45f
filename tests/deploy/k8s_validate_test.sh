#!/usr/bin/env bash
# kubernetes-validate (PyPI) --strict on every manifest in deploy/k8s/, against
# the Kubernetes schemas it ships, and the pieces the deployment relies on.
# Usage: k8s_validate_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
VALIDATE=$(find_tool kubernetes-validate "$2")
shopt -s nullglob
manifests=("$SRC"/deploy/k8s/*.yaml)
((${#manifests[@]} >= 6)) || fail "expected at least 6 manifests in deploy/k8s, found ${#manifests[@]}"
"$VALIDATE" --strict --quiet "${manifests[@]}"
all=$(cat "${manifests[@]}")
for kind in Namespace StatefulSet DaemonSet ConfigMap Secret Service; do
  grep -q "^kind: $kind\$" <<<"$all" || fail "no $kind in deploy/k8s"
done
grep -q 'clusterIP: None' <<<"$all" || fail "the server Service is not headless"
grep -q 'nvidia.com/gpu: 1' <<<"$all" || fail "workers do not request nvidia.com/gpu"
grep -q 'prometheus.io/scrape: "true"' <<<"$all" || fail "no Prometheus scrape annotations"
echo "PASS: kubernetes-validate (${#manifests[@]} manifests)"
