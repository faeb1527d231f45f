#!/usr/bin/env bash
# The concurrency checks (docs/ARCHITECTURE.md, "Concurrency checks"):
#
#   1. build-tsan/absl/: the installed Debian abseil, rebuilt from its Debian
#      source package with -fsanitize=thread. Debian's libabsl_synchronization
#      is not instrumented, so TSan would not see any absl::Mutex (ours or
#      gRPC's) and would report every guarded member as a race. Only the
#      locking libraries are swapped in (build-tsan/absl/sync-lib: Mutex,
#      CondVar, SpinLock and every abseil library that takes a SpinLock, so
#      that its inline Lock() matches the instrumented SlowLock()); the rest
#      stays Debian's, uninstrumented like gRPC, which calls it on its own
#      objects from its own threads.
#   2. build-tsan/: everything but CUDA, built once with clang for both
#      checks: -fsanitize=thread (-DPSTRAIN_SANITIZE=thread, RelWithDebInfo)
#      and the lock-annotation analysis
#      (-DPSTRAIN_THREAD_SAFETY_ANALYSIS=ON: -Wthread-safety as errors, on
#      top of the usual warnings as errors). Then the in-process tests under
#      TSan: `ctest -L 'unit|loopback'` (unit tests, and the loopback
#      PsClient <-> ParameterService tests; never the multi-process
#      clusters). The first TSan report fails its test
#      (tests/tsan_defaults.cc.in); tests/tsan_suppressions.txt holds
#      third-party entries only.
#
#   deploy/local/sanitize.sh          # both; ends with "sanitize: PASSED" or "FAILED"
#   deploy/local/sanitize.sh tsan     # the same
#   deploy/local/sanitize.sh tsa      # only the lock annotations, in build-tsa/ at -O0
#                                     # (no abseil rebuild, no tests: the quick check)
#
# Environment: PSTRAIN_TSA_BUILD_DIR (default build-tsa), PSTRAIN_TSAN_BUILD_DIR
# (default build-tsan), PSTRAIN_SANITIZE_JOBS (default: the cores),
# PSTRAIN_NICE (e.g. "nice -n 19" on a shared machine; default none). Needs
# clang, libclang-rt-dev, libomp-dev and dpkg-dev (PSTRAIN_TEST_TOOLS=1
# deploy/local/install-deps.sh), and Debian's archive for the abseil source
# package (fetched once, into build-tsan/absl/, with apt's own client and a
# private list of deb-src entries; the system's apt configuration is not
# touched). Timing on a 2-core machine: docs/ARCHITECTURE.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT="${1:-all}"
TSA_DIR="${PSTRAIN_TSA_BUILD_DIR:-build-tsa}"
TSAN_DIR="${PSTRAIN_TSAN_BUILD_DIR:-build-tsan}"
JOBS="${PSTRAIN_SANITIZE_JOBS:-$(nproc)}"
read -r -a NICE <<<"${PSTRAIN_NICE:-}"
case "$WHAT" in all | tsa | tsan) ;; *)
  echo "usage: $0 [all|tsa|tsan]" >&2
  exit 2
  ;;
esac

fail() {
  echo "sanitize: FAILED ($*)"
  exit 1
}
for tool in clang++ dpkg-source apt-get llvm-symbolizer; do
  command -v "$tool" >/dev/null ||
    fail "$tool is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
done
step_start=0
begin() {
  step_start=$SECONDS
  echo "sanitize: $*"
}
took() { echo "sanitize: $* took $((SECONDS - step_start)) s"; }
CLANG=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DPSTRAIN_WITH_CUDA=OFF)

# --- The lock annotations alone (sanitize.sh tsa) ------------------------------
if [[ "$WHAT" == tsa ]]; then
  begin "thread-safety analysis build in $TSA_DIR"
  cmake -S . -B "$TSA_DIR" -G Ninja "${CLANG[@]}" -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_C_FLAGS_DEBUG=-O0 \
    -DPSTRAIN_THREAD_SAFETY_ANALYSIS=ON -DPSTRAIN_WERROR=ON >/dev/null ||
    fail "configuring $TSA_DIR"
  "${NICE[@]}" cmake --build "$TSA_DIR" -j "$JOBS" ||
    fail "the thread-safety build: a lock annotation is not satisfied (see above)"
  took "the thread-safety build"
fi

build_tsan_abseil() {
  local root="$TSAN_DIR/absl" source version suite
  source=$(dpkg-query -W -f='${source:Package}' libabsl-dev)
  version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
  ABSL_LIBDIR="$PWD/$root/sync-lib"
  if [[ -f "$root/sync-lib/VERSION" && "$(cat "$root/sync-lib/VERSION")" == "$version" ]]; then
    echo "sanitize: abseil $version with TSan already in $root/install"
    return
  fi
  begin "abseil $version from Debian's source package, rebuilt with TSan in $root"
  rm -rf "$root"
  mkdir -p "$root/apt/lists/partial" "$root/apt/cache/archives/partial"
  root=$(cd "$root" && pwd)
  # deb-src entries for the same archive as the machine's Debian entries.
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    sed 's/^Types:.*/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
      >"$root/apt/debian.sources"
  else
    suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s %s-updates\nComponents: main\n\nTypes: deb-src\nURIs: http://deb.debian.org/debian-security\nSuites: %s-security\nComponents: main\n' \
      "$suite" "$suite" "$suite" >"$root/apt/debian.sources"
  fi
  local apt=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$root/apt"
    -o "Dir::State::Lists=$root/apt/lists" -o "Dir::Cache=$root/apt/cache"
    -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root" -q)
  apt-get "${apt[@]}" update >/dev/null || fail "apt-get update of the deb-src entries"
  (cd "$root" && apt-get "${apt[@]}" source --download-only "$source=$version" >/dev/null) ||
    fail "apt-get source $source=$version (is that version still in the archive?)"
  # apt checked the files against the archive's signed index; dpkg-source
  # cannot check the .dsc's own signature without debian-keyring (a warning).
  (cd "$root" && dpkg-source -x ./*.dsc src >/dev/null) || fail "dpkg-source -x $source"
  # debian/rules' shared build (C++17, shared libraries) plus TSan.
  cmake -S "$root/src" -B "$root/build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 -DABSL_PROPAGATE_CXX_STD=ON \
    -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF -DCMAKE_CXX_FLAGS=-fsanitize=thread \
    -DCMAKE_INSTALL_PREFIX="$root/install" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null ||
    fail "configuring abseil"
  "${NICE[@]}" cmake --build "$root/build" -j "$JOBS" || fail "building abseil with TSan"
  cmake --install "$root/build" >/dev/null || fail "installing abseil"
  # The locking libraries, found by what Debian's own libraries import.
  local system_dir lib name
  system_dir=$(dirname "$(dpkg -L libabsl-dev | grep '/libabsl_synchronization\.so$')")
  mkdir -p "$root/sync-lib"
  for lib in "$system_dir"/libabsl_*.so.*.*; do
    name=$(basename "$lib")
    name=${name%%.so.*}
    if [[ "$name" =~ ^libabsl_(synchronization|base|spinlock_wait)$ ]] ||
      nm -D --undefined-only "$lib" | grep -q 'SpinLock.*Slow\(Lock\|Unlock\)'; then
      cp -P "$root/install/lib/$name".so* "$root/sync-lib/"
    fi
  done
  [[ -f "$root/sync-lib/libabsl_synchronization.so" ]] || fail "no abseil locking libraries found"
  echo "$version" >"$root/sync-lib/VERSION"
  took "abseil with TSan"
}

# --- 2. One clang build for both checks, then the tests under TSan ----------
if [[ "$WHAT" == all || "$WHAT" == tsan ]]; then
  build_tsan_abseil
  begin "ThreadSanitizer and thread-safety analysis build in $TSAN_DIR"
  # Full debug information (RelWithDebInfo's -O2 -g): with line tables only
  # the inlined gRPC frames lose their qualified names, and the suppressions
  # (tests/tsan_suppressions.txt) match those names.
  # -Wno-error=pass-failed: a `#pragma omp simd` loop that TSan's
  # instrumentation keeps from vectorizing is a warning, not an error.
  cmake -S . -B "$TSAN_DIR" -G Ninja "${CLANG[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g -DNDEBUG -Wno-error=pass-failed" \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g -DNDEBUG -Wno-error=pass-failed" \
    -DPSTRAIN_SANITIZE=thread -DPSTRAIN_TSAN_ABSL_LIBDIR="$ABSL_LIBDIR" \
    -DPSTRAIN_THREAD_SAFETY_ANALYSIS=ON -DPSTRAIN_WERROR=ON \
    -DPSTRAIN_BUILD_BENCH=OFF -DPSTRAIN_BUILD_PYTHON=OFF >/dev/null ||
    fail "configuring $TSAN_DIR"
  # Every C++ target but the benchmarks and the Python extension (no lock of
  # their own; their tests do not run under TSan), so that every file's lock
  # annotations are checked; only the unit and loopback tests run below.
  "${NICE[@]}" cmake --build "$TSAN_DIR" -j "$JOBS" ||
    fail "the TSan build: a lock annotation is not satisfied, or it does not compile (see above)"
  took "the TSan build"
  # One test at a time: TSan slows every thread several times, and the TLS
  # handshakes of the security tests must finish within gRPC's connect
  # timeout (common/rpc/channel.cc: 100 ms for a first attempt).
  begin "the unit and loopback tests under TSan"
  (cd "$TSAN_DIR" && "${NICE[@]}" ctest --output-on-failure -L 'unit|loopback' -j 1 \
    --timeout 1800) || fail "a test under TSan (a data race, a lock-order inversion or a failure; see above)"
  took "the tests under TSan"
fi
echo "sanitize: PASSED ($WHAT, $SECONDS s)"
