#!/usr/bin/env bash
# The fuzzing step of the README's test command (deploy/local/test.sh runs
# it): builds the libFuzzer targets and the parsers' unit tests with clang,
# AddressSanitizer and UBSan into build-fuzz/, runs the unit tests, then each
# fuzzer for a bounded number of inputs from its seed corpus
# (tests/fuzz/corpus/). Any crash, sanitizer report, leak or timeout fails it.
#
#   deploy/local/fuzz.sh                          # what CI runs (about 2 minutes of fuzzing)
#   PSTRAIN_FUZZ_RUNS=2000000 PSTRAIN_FUZZ_SECONDS=600 deploy/local/fuzz.sh   # a longer run
#
# Environment: PSTRAIN_FUZZ_BUILD_DIR (default build-fuzz), PSTRAIN_FUZZ_RUNS
# (inputs per fuzzer, default 1000000), PSTRAIN_FUZZ_SECONDS (cap per fuzzer,
# default 15). Needs clang and libclang-rt-dev (PSTRAIN_TEST_TOOLS=1
# deploy/local/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${PSTRAIN_FUZZ_BUILD_DIR:-build-fuzz}"
RUNS="${PSTRAIN_FUZZ_RUNS:-1000000}"
SECONDS_MAX="${PSTRAIN_FUZZ_SECONDS:-15}"
command -v clang++ >/dev/null || { echo "fuzz: clang++ is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"; exit 1; }
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DPSTRAIN_FUZZ=ON -DPSTRAIN_FUZZ_RUNS="$RUNS" -DPSTRAIN_FUZZ_SECONDS="$SECONDS_MAX" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
cd "$BUILD_DIR"
# The parsers' unit tests under ASan + UBSan, then the fuzzers one at a time
# (each is bounded by RUNS and SECONDS).
ctest --output-on-failure -L sanitizers -j "$(nproc)"
ctest --output-on-failure -L fuzz
