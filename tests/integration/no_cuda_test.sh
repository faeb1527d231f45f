#!/usr/bin/env bash
# One worker binary for every node: pstrain-worker, pstrain-server and pstrain
# link no CUDA library, start and train with /usr/local/cuda hidden, and
# `--device cuda` says which of module, library or device is missing.
#
#   no_cuda_test.sh BIN_DIR SOURCE_DIR
#
# 1. No CUDA library is NEEDED by the three binaries (readelf).
# 2. With /usr/local/cuda present (no GPU here): --device cuda fails with
#    "no CUDA device is visible" (or "not found" in a build without CUDA);
#    auto trains on the CPU.
# 3. In a private mount namespace with /usr/local/cuda replaced by an empty
#    tmpfs: --version, a short standalone run on the CPU, --device cuda naming
#    the missing library, and a server + worker job through the CLI.
# 4. PSTRAIN_CUDA_MODULE, or --cuda-module, pointing nowhere: "was not found
#    (looked for ...)".
# Exits 77 (skipped) for the parts that need root and unshare when they are
# unavailable; never passes silently.
set -euo pipefail
BIN=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
JOB=$SRC/examples/fashion-mnist.json
DATA=/usr/share/datasets/fashion-mnist
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -d $DATA ]] || fail "$DATA missing: install dataset-fashion-mnist (deploy/local/install-deps.sh)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
module_built=0
[[ -f $BIN/../lib/libpstrain_cuda.so ]] && module_built=1

echo "== 1. no CUDA library linked"
for b in pstrain-worker pstrain-server pstrain; do
  if readelf -d "$BIN/$b" | grep -E 'NEEDED.*(libcuda|libcudart|libcublas|libcudnn|libnvidia)'; then
    fail "$b links a CUDA library"
  fi
done
echo "ok"

has_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

# run_expect_fail OUT_FILE CMD...: the command must exit non-zero.
run_expect_fail() {
  local out=$1; shift
  if "$@" >"$out" 2>&1; then cat "$out"; fail "$* succeeded"; fi
  cat "$out"
}

echo "== 2. CUDA libraries present, no GPU"
if ((has_gpu)); then
  echo "a GPU is present: skipping the no-device message check"
else
  run_expect_fail "$WORK/cuda.txt" "$BIN/pstrain-worker" --standalone "$JOB" --device cuda --checkpoint none
  if ((module_built)); then
    grep -q "no CUDA device is visible" "$WORK/cuda.txt" || fail "no 'no CUDA device is visible' message"
  else
    grep -q "CUDA module libpstrain_cuda.so was not found" "$WORK/cuda.txt" || fail "no 'not found' message"
  fi
  grep -q "use --device cpu" "$WORK/cuda.txt" || fail "the message does not say what to do"
fi

echo "== 4. PSTRAIN_CUDA_MODULE and --cuda-module pointing nowhere"
PSTRAIN_CUDA_MODULE=$WORK/absent/libpstrain_cuda.so run_expect_fail "$WORK/absent.txt" \
  "$BIN/pstrain-worker" --standalone "$JOB" --device cuda --checkpoint none
grep -q "was not found (looked for $WORK/absent/libpstrain_cuda.so)" "$WORK/absent.txt" ||
  fail "the not-found message does not name the path tried"
# --cuda-module says the same, and wins over the variable.
PSTRAIN_CUDA_MODULE=$WORK/absent/libpstrain_cuda.so run_expect_fail "$WORK/flag.txt" \
  "$BIN/pstrain-worker" --standalone "$JOB" --device cuda --checkpoint none \
  --cuda-module "$WORK/flag/libpstrain_cuda.so"
grep -q "was not found (looked for $WORK/flag/libpstrain_cuda.so)" "$WORK/flag.txt" ||
  fail "--cuda-module is not the path tried"

echo "== 3. /usr/local/cuda hidden"
# A private mount namespace. In a chroot (fresh-machine) unshare cannot make
# "/" private, so the namespace keeps the propagation it has and only the
# mount that is covered, /usr/local/cuda (a bind mount there), is made
# private first: nothing mounted below can reach the parent namespace.
if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP: hiding /usr/local/cuda needs root"
  exit 77
fi
UNSHARE=(unshare -m)
PRIVATE=""
if ! unshare -m true 2>/dev/null; then
  if mountpoint -q /usr/local/cuda && unshare -m --propagation unchanged true 2>/dev/null; then
    UNSHARE=(unshare -m --propagation unchanged)
    PRIVATE="mount --make-private /usr/local/cuda"
  else
    echo "SKIP: unshare -m is not permitted here: $(unshare -m true 2>&1)"
    exit 77
  fi
fi
cat >"$WORK/hidden.sh" <<INNER
set -euo pipefail
mkdir -p /usr/local/cuda
$PRIVATE
mount -t tmpfs -o size=1m pstrain-no-cuda /usr/local/cuda
# The libraries the CUDA module needs (cudart is linked into it statically)
# must now be gone; a copy elsewhere on the loader's path would defeat the test.
for lib in libcublas.so.13 libcublasLt.so.13 libcudnn.so.9; do
  for path in \$(ldconfig -p | awk -v l="\$lib" '\$1 == l {print \$NF}'); do
    if [[ -e \$path ]]; then echo "SKIP: \$path is installed outside /usr/local/cuda"; exit 77; fi
  done
done
"$BIN/pstrain-worker" --version
"$BIN/pstrain-server" --version
"$BIN/pstrain" version
echo "-- standalone, device auto"
"$BIN/pstrain-worker" --standalone "$JOB" --device auto --epochs 1 --limit 1024 \
  --checkpoint none > "$WORK/auto.txt"
tail -1 "$WORK/auto.txt"
tail -1 "$WORK/auto.txt" | grep -q '"device": "cpu"'
echo "-- standalone, device cuda"
if "$BIN/pstrain-worker" --standalone "$JOB" --device cuda --checkpoint none > "$WORK/nolib.txt" 2>&1; then
  cat "$WORK/nolib.txt"; echo "FAIL: --device cuda succeeded without CUDA"; exit 1
fi
cat "$WORK/nolib.txt"
if [[ $module_built == 1 ]]; then
  grep -Eq "could not be loaded: lib(cublas|cublasLt|cudnn)[^ ]*\.so[^ ]*: cannot open shared object file" "$WORK/nolib.txt"
else
  grep -q "was not found" "$WORK/nolib.txt"
fi
echo "-- a server and a worker train a job through the CLI"
port=\$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN/pstrain-server" --listen 127.0.0.1:\$port --state-dir "$WORK/state" > "$WORK/server.log" 2>&1 &
server=\$!
"$BIN/pstrain-worker" --server 127.0.0.1:\$port --device auto --threads 1 > "$WORK/worker.log" 2>&1 &
worker=\$!
trap 'kill \$server \$worker 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for i in \$(seq 1 100); do
  "$BIN/pstrain" --server 127.0.0.1:\$port --timeout-ms 1000 list >/dev/null 2>&1 && break
  ((i < 100)) || { cat "$WORK/server.log"; echo "FAIL: the server did not come up in 30 s"; exit 1; }
  sleep 0.3
done
cat > "$WORK/job.json" <<JOB
{"name": "no-cuda", "model_file": "$SRC/examples/models/fmnist-cnn.json",
 "dataset": {"format": "DATASET_FORMAT_IDX", "path": "$DATA", "mean": [0.2860], "std": [0.3530],
             "train_limit": 1024, "test_limit": 512},
 "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.01, "momentum": 0.9},
 "epochs": 1, "batch_size": 64, "workers": 1}
JOB
timeout 300 "$BIN/pstrain" --server 127.0.0.1:\$port submit "$WORK/job.json" --watch
grep -q "training on the CPU: .*libpstrain_cuda.so could not be loaded\|training on the CPU: .*was not found" "$WORK/worker.log" || { cat "$WORK/worker.log"; echo "FAIL: the worker did not say why it trains on the CPU"; exit 1; }
INNER
set +e
"${UNSHARE[@]}" bash "$WORK/hidden.sh"
rc=$?
set -e
((rc == 77)) && exit 77
((rc == 0)) || fail "the run with /usr/local/cuda hidden failed (exit $rc)"
echo "PASS: no_cuda"
