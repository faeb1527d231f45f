#!/usr/bin/env bash
# The README's test command: installs what the build needs, builds everything
# (warnings as errors) and runs the whole GoogleTest suite through ctest. GPU
# tests skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh
export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR="${PSTRAIN_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSTRAIN_WERROR=ON
cmake --build "$BUILD_DIR" -j "$(nproc)"
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 900 -j "$(nproc)"
