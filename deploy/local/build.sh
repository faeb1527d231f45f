#!/usr/bin/env bash
# Configures and builds pstrain into build/ (binaries in build/bin/).
# Usage: deploy/local/build.sh [extra cmake -D flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR="${PSTRAIN_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
