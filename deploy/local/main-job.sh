#!/usr/bin/env bash
# The README's main-job command: installs what it needs, builds, and trains
# fmnist-cnn on Fashion-MNIST (examples/fashion-mnist.json) with the
# standalone engine, on the GPU when one is present, else on the CPU. Extra
# arguments go to pstrain-worker (e.g. --device cpu, --epochs 2).
#
# The distributed version (one server, two workers on 127.0.0.1) replaces this
# body when pstrain-server lands; the engine and the job file stay the same.
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/install-deps.sh
deploy/local/build.sh >/dev/null
exec build/bin/pstrain-worker --standalone examples/fashion-mnist.json --device auto \
  --checkpoint fashion-mnist.ckpt "$@"
