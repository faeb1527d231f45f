#!/usr/bin/env bash
# Installs the Debian packages pstrain builds and runs with. Idempotent: does
# nothing when everything is already there. CUDA, cuDNN and cuBLAS come from
# the machine's toolkit at /usr/local/cuda, not from here.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
  # ocl-icd-opencl-dev: oneDNN's CMake config looks for OpenCL (a Recommends
  # of libdnnl-dev, which --no-install-recommends skips).
  libdnnl-dev ocl-icd-opencl-dev libopenblas-dev
  libjpeg62-turbo-dev libpng-dev zlib1g-dev
  # libbson-dev: the Cdiscount BSON product dump (DATASET_FORMAT_BSON).
  libbson-dev
  # libcurl4-openssl-dev: s3:// datasets (HTTP and libcurl's AWS SigV4 signing).
  libcurl4-openssl-dev
  # libssl-dev: token digests and worker credentials; openssl: the local
  # cluster's CA, certificates and tokens (deploy/local/make-certs.sh).
  libssl-dev openssl
  # libonnx-dev: ONNX's protobuf schema for `pstrain export` (and its C++
  # checker for the tests).
  libonnx-dev
  # The Python package (python/): its pstrain.v1 modules are generated at
  # build time by python3 with protoc and grpc_python_plugin (above); it runs
  # on Debian's gRPC, protobuf and numpy.
  python3 python3-grpcio python3-protobuf python3-numpy
  # python3-onnx: the Python client's Checkpoint.export_onnx().
  python3-onnx
  # pstrain.torch: the user's PyTorch models (CPU builds of Debian's torch
  # and torchvision), through pstrain._native, the C++ worker protocol
  # built as a Python extension with pybind11 against Debian's python3.
  python3-torch python3-torchvision pybind11-dev python3-dev
  # openjdk-17-jre-headless: PySpark's JVM (pstrain.spark).
  openjdk-17-jre-headless
  dataset-fashion-mnist
)
if [[ "${PSTRAIN_TEST_TOOLS:-0}" == 1 ]]; then
  # Test-only tools: promtool and a real Prometheus (tests/tools/prometheus_test.sh).
  PACKAGES+=(prometheus curl)
  # deploy/local/test.sh's venv of PyPI test tools (tensorboard).
  PACKAGES+=(python3 python3-venv)
  # tests/python/: the Python package's tests (ctest python_client_*), and
  # setuptools and wheel for its `pip install ./python` check.
  PACKAGES+=(python3-pytest python3-setuptools python3-wheel)
  # tests/deploy/: compose validation and the console screenshot.
  PACKAGES+=(docker-compose chromium)
  # tests/deploy/containers_test.sh: a Docker engine and client, and the
  # local Debian base image (deploy/docker/base-image.sh).
  PACKAGES+=(docker.io mmdebstrap iproute2)
  # deploy/local/fuzz.sh: clang with libFuzzer and the sanitizer runtimes.
  PACKAGES+=(clang libclang-rt-dev)
  # deploy/local/sanitize.sh: clang's OpenMP runtime and its TSan tool
  # libarcher (the kernels' OpenMP loops under clang); dpkg-source (from
  # build-essential's dpkg-dev) unpacks abseil's Debian source package;
  # llvm's llvm-symbolizer names the frames of a TSan report, without which
  # tests/tsan_suppressions.txt matches nothing (seen on a fresh machine:
  # every gRPC test reported races in unnamed frames).
  PACKAGES+=(libomp-dev dpkg-dev llvm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -q
  # Packages must not start services here: docker.io's own dockerd would make
  # a bridge network (the container test starts an engine of its own, host
  # networking only). policy-rc.d tells invoke-rc.d and deb-systemd-invoke
  # not to start anything; one already there is left alone.
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
