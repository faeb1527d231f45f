#!/usr/bin/env bash
# Every GPU check of issue 10 in one command, for a lent GPU machine (the
# device tool: ../.library/device/README.md), where time is short:
#
#   env          the GPU, driver, CUDA, cuDNN, and what pstrain-worker --version finds
#   tests        the GPU tests (CUDA/CPU parity, prefetcher on cuda, NVML, the
#                CUDA module loader, end-to-end training) straight from their
#                binaries, none of them allowed to skip
#   accuracy     pstrain-worker --standalone examples/fashion-mnist.json --device cuda
#                with /metrics sampled every second: test accuracy, time, samples/s,
#                and pstrain_worker_gpu_utilization_ratio over the training window
#   busy         the same sampling on resnet-small (3x64x64, batch 128, synthetic), in
#                each of BUSY_PRECISIONS (default fp32)
#   transforms   conv parity and speed with cuDNN's FFT/Winograd algorithms allowed or not
#   speed        bench/train_gpu_vs_pytorch.py: pstrain against PyTorch eager, same GPU
#                (SPEED_PRECISIONS=fp32,bf16,fp16 adds mixed precision against
#                PyTorch autocast; SPEED_CASES=resnet runs one model)
#   mixed        mixed precision (issue 10 part 6): standalone Fashion-MNIST in fp32,
#                bf16 and fp16 (accuracy, time, skipped fp16 steps), then a sync job
#                of one server and two bf16 workers
#   distributed  one server and two CUDA workers on loopback, sync then async,
#                3 epochs (EPOCHS): accuracy, wall time, each worker's step-phase histogram
#   layers       bench/gpu_layers_bench: per-layer forward/backward ms of resnet-small
#                (b128) and fmnist-cnn (b256) in fp32, bf16 and fp16
#   integration  distributed_training_test (real processes, CUDA workers), filtered by
#                INTEGRATION_FILTER (default: the pull-compression shard-restart test,
#                whose deltas land in the CUDA staging buffers)
#   ctest        the ctest suite, less what needs tools the machine lacks (python,
#                containers, deploy, Prometheus, TensorBoard) and the Python venvs
#   cpuhost      not GPU work, and not in the default list: the device's host CPU
#                (an Intel Xeon with 16 cores, where ours is an AMD EPYC) for issue
#                11 part 0 and issue 8's TLS figure: transport_bench plaintext and
#                with TLS + mTLS + tokens on 2 and on 4 cores (taskset), with 1
#                and 2 connections per shard (CPUHOST_CONNECTIONS),
#                bench/train_cpu_vs_pytorch.py on 2 cores, as the issue's Xeon had,
#                and cpu_ops_bench on the same 2 cores with Winograd's products in
#                256- and in 512-bit registers (--width), alternating
#   tlsnet       not GPU work, not in the default list: issue 8's TLS goal over
#                emulated links on a host with cores to spare:
#                bench/cluster_emulation.sh tls (TLSNET_RATES, default 10gbit;
#                TLSNET_SIZES, default "1:1 2:2") with each emulated host on
#                TLSNET_CORES_PER_HOST (3) cores of its own and workers on
#                TLSNET_CONNECTIONS (2) connections per shard each way,
#                iproute2 from the bundle where the image lacks it; the summary
#                has the TLS cost of each point
#
# Usage: bench/gpu_session.sh [STAGE...]       (default: every stage, in that order)
# On the device machine the build comes from .devcarry/bundle.tar.xz
# (bench/gpu_bundle.sh makes it here); results go to $OUT (default
# /tmp/pstrain-gpu-session): summary.txt plus one log per stage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/pstrain-gpu-session}
mkdir -p "$OUT"
BIN=$ROOT/build/bin
STAGES=("$@")
((${#STAGES[@]})) || STAGES=(env tests accuracy busy speed distributed ctest)
SUMMARY=$OUT/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }
T0=$(date +%s)
elapsed() { echo "$(($(date +%s) - T0))s"; }

# --- Setup on the device machine: unpack the build, the libraries and the data.
if [[ -f .devcarry/bundle.tar.xz && ! -x $BIN/pstrain-worker ]]; then
  tar -xJf .devcarry/bundle.tar.xz 2>/dev/null ||
    python3 -c 'import tarfile; tarfile.open(".devcarry/bundle.tar.xz").extractall()' ||
    { say "setup: cannot unpack the bundle"; exit 1; }
  if [[ ! -d /usr/share/datasets/fashion-mnist ]]; then
    mkdir -p /usr/share/datasets && cp -r devdata/fashion-mnist /usr/share/datasets/
  fi
  # ctest files name the build tree by the path it was configured in.
  CONFIGURED=$(sed -n 's/^# Build directory: //p' build/CTestTestfile.cmake)
  if [[ -n $CONFIGURED && ! -e $CONFIGURED ]]; then
    mkdir -p "$(dirname "$(dirname "$CONFIGURED")")"
    ln -sfn "$ROOT" "$(dirname "$CONFIGURED")"
  fi
fi
if [[ -d build/devlibs ]]; then
  # cuDNN and cuBLAS of the machine (PyTorch's wheels, or the toolkit's).
  CUDA_DIRS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libcudnn.so.9' -o -name 'libcublas.so.13' \) \
                -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
  export LD_LIBRARY_PATH="$ROOT/build/devlibs:${CUDA_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
PY=${PY:-python3}
# For a dry run of the script on a machine without a GPU: DEVICE=cpu,
# ACCURACY_ARGS="--epochs 1 --limit 2000", EPOCHS=1.
DEVICE=${DEVICE:-cuda}
EPOCHS=${EPOCHS:-3}
free_port() {
  $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

stage_env() {
  {
    echo "== env $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nvidia-smi | sed -n 3p
    "$BIN/pstrain-worker" --version
    $PY -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))'
    lscpu | sed -n 's/^Model name: *//p'
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  } >"$OUT/env.log" 2>&1
  say "env: $(sed -n 2p "$OUT/env.log") | $(grep -m1 'cuda module' "$OUT/env.log")"
}

stage_tests() {
  local log=$OUT/tests.log failed=0
  : >"$log"
  for t in ${TESTS:-cuda_parity_test mixed_precision_parity_test mixed_precision_test \
           data_prefetcher_test gpu_monitor_test backend_loader_test train_e2e_test trainer_test \
           layers_test}; do
    echo "== $t" >>"$log"
    timeout 120 "$BIN/$t" --gtest_brief=0 >>"$log" 2>&1
    local rc=$?
    local passed skipped
    passed=$(grep -c '^\[       OK \]' <(sed -n "/^== $t\$/,\$p" "$log"))
    skipped=$(grep -c '^\[  SKIPPED \]' <(sed -n "/^== $t\$/,\$p" "$log"))
    say "tests: $t rc=$rc passed=$passed skipped=$skipped"
    ((rc == 0)) || failed=1
  done
  # The same binaries with the CUDA backend's other routes forced: the two
  # backward passes of a convolution in order (not on two streams), bf16
  # and fp16 convolutions always, or never, via fp32, bf16 and fp16 models
  # in NCHW instead of channels last, and pstrain's own narrow-convolution
  # kernels always, or never, where they apply.
  local variant
  for variant in ${TEST_VARIANTS-"PSTRAIN_CUDNN_CONCURRENT_BACKWARD=0:cuda_parity_test" \
                 "PSTRAIN_CUDNN_FP32_ROUTE=always:mixed_precision_parity_test" \
                 "PSTRAIN_CUDNN_FP32_ROUTE=always:mixed_precision_test" \
                 "PSTRAIN_CUDNN_FP32_ROUTE=0:mixed_precision_parity_test" \
                 "PSTRAIN_CUDNN_NHWC=0:mixed_precision_test" \
                 "PSTRAIN_CUDA_OWN_CONV=always:mixed_precision_parity_test" \
                 "PSTRAIN_CUDA_OWN_CONV=always:mixed_precision_test" \
                 "PSTRAIN_CUDA_OWN_CONV=0:mixed_precision_parity_test"}; do
    local setting=${variant%%:*} t=${variant#*:}
    echo "== $t ($setting)" >>"$log"
    env "$setting" timeout 120 "$BIN/$t" --gtest_brief=0 >>"$log" 2>&1
    local rc=$?
    local passed skipped
    passed=$(grep -c '^\[       OK \]' <(sed -n "/^== $t ($setting)\$/,\$p" "$log"))
    skipped=$(grep -c '^\[  SKIPPED \]' <(sed -n "/^== $t ($setting)\$/,\$p" "$log"))
    say "tests: $t with $setting rc=$rc passed=$passed skipped=$skipped"
    ((rc == 0)) || failed=1
  done
  grep -E '^\[  FAILED  \]|Failure$' "$log" | sort -u | head -40 >>"$SUMMARY"
  return $failed
}

# sampled_run NAME JOB [ARGS...]: trains JOB standalone with /metrics on and
# samples the per-GPU gauges every second; NAME.log gets the timed output and
# the samples, NAME-metrics.prom the last scrape.
sampled_run() {
  local name=$1 job=$2 port
  shift 2
  port=$(free_port)
  timeout 240 $PY - "$BIN/pstrain-worker" "$port" "$OUT" "$DEVICE" "$name" "$job" "$@" <<'PY' 2>&1 | tee -a "$SUMMARY"
import json, re, statistics, subprocess, sys, threading, time, urllib.request
binary, port, out, device, name, job = sys.argv[1:7]
cmd = [binary, "--standalone", job, "--device", device,
       "--checkpoint", "none", "--metrics-port", port] + sys.argv[7:]
t0 = time.time()
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
samples, lines, done = [], [], threading.Event()
def sample():
    while not done.is_set():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
            t = time.time() - t0
            for m in re.finditer(r'^pstrain_worker_gpu_utilization_ratio\{([^}]*)\} (\S+)', text, re.M):
                samples.append((t, m.group(1), float(m.group(2))))
            sample.last = text
        except Exception:
            pass
        done.wait(1.0)
sample.last = ""
threading.Thread(target=sample, daemon=True).start()
for line in proc.stdout:
    lines.append((time.time() - t0, line.rstrip("\n")))
proc.wait()
done.set()
wall = time.time() - t0
with open(f"{out}/{name}.log", "w") as f:
    for t, line in lines:
        f.write(f"{t:8.2f} {line}\n")
    f.write("\n# pstrain_worker_gpu_utilization_ratio samples (seconds since start, labels, value)\n")
    for t, labels, v in samples:
        f.write(f"{t:8.2f} {labels} {v}\n")
with open(f"{out}/{name}-metrics.prom", "w") as f:
    f.write(sample.last)
start = next((t for t, l in lines if "training" in l and "pstrain-worker:" in l), None)
end = max((t for t, l in lines if l.startswith("epoch ")), default=None)  # The last epoch's end.
result = lines[-1][1] if lines else ""
print(f"{name}: rc={proc.returncode} wall={wall:.1f}s last line: {result}")
if start is not None and end is not None:
    window = [v for t, _, v in samples if start + 1.5 <= t <= end]
    if window:
        print(f"{name}: GPU utilization over the training window ({end - start:.1f} s, "
              f"{len(window)} samples): mean {statistics.mean(window):.3f}, "
              f"median {statistics.median(window):.3f}, min {min(window):.3f}")
for t, l in lines:
    if l.startswith("epoch ") or l.startswith("test:") or "training" in l:
        print("   ", l)
PY
}

stage_accuracy() {
  sampled_run accuracy examples/fashion-mnist.json ${ACCURACY_ARGS:-}
}

# GPU busy time on a model that is not launch-bound: resnet-small, batch 128.
stage_busy() {
  local p
  for p in ${BUSY_PRECISIONS:-fp32}; do
    sampled_run "busy-$p" bench/jobs/resnet-small-64-synthetic.json --epochs "${BUSY_EPOCHS:-8}" \
      --precision "$p"
  done
}

stage_speed() {
  timeout "${SPEED_SECONDS:-300}" $PY bench/train_gpu_vs_pytorch.py --binary "$BIN/pstrain-worker" \
    --rounds "${SPEED_ROUNDS:-3}" --epochs "${SPEED_EPOCHS:-4}" \
    --precisions "${SPEED_PRECISIONS:-fp32}" --cases "${SPEED_CASES:-fmnist,resnet}" \
    >"$OUT/speed.log" 2>&1
  say "speed: rc=$? $(elapsed)"
  grep -v '^  ' "$OUT/speed.log" | tail -8 | sed 's/^/speed: /' | tee -a "$SUMMARY" >/dev/null
}

# Mixed precision: the Fashion-MNIST example standalone in each precision
# (accuracy within 0.3 points of fp32 is the goal), then a distributed sync
# job with bf16 workers.
stage_mixed() {
  local p
  for p in ${MIXED_PRECISIONS:-fp32 bf16 fp16}; do
    timeout 120 "$BIN/pstrain-worker" --standalone examples/fashion-mnist.json --device "$DEVICE" \
      --checkpoint none --precision "$p" ${ACCURACY_ARGS:-} >"$OUT/mixed-$p.log" 2>&1
    say "mixed $p: rc=$? $(tail -1 "$OUT/mixed-$p.log")"
    grep '^epoch ' "$OUT/mixed-$p.log" | tail -2 | sed "s/^/mixed $p: /" | tee -a "$SUMMARY" >/dev/null
  done
  DIST_MODES=sync DIST_PRECISION=bf16 stage_distributed
}

# Which cuDNN algorithms may compete (PSTRAIN_CUDNN_TRANSFORMS, see
# kernels/cuda_backend_options.h): CUDA/CPU convolution parity and the steady
# training rate under each setting, beside PyTorch eager fp32 in the same run.
stage_transforms() {
  timeout "${TRANSFORMS_SECONDS:-200}" $PY - "$BIN" <<'PY' 2>&1 | tee "$OUT/transforms.log" | tee -a "$SUMMARY"
import os, statistics, subprocess, sys
sys.path.insert(0, "bench")
import train_gpu_vs_pytorch as b
binary_dir = sys.argv[1]
settings = ["none", "fft", "winograd", "fft,winograd"]
for t in settings:
    env = dict(os.environ, PSTRAIN_CUDNN_TRANSFORMS=t)
    r = subprocess.run([f"{binary_dir}/cuda_parity_test", "--gtest_filter=*Convolution*"], env=env,
                       capture_output=True, text=True)
    worst = [l for l in r.stdout.splitlines() if "Expected" in l or "worst element" in l]
    print(f"transforms '{t}': conv parity rc={r.returncode} {' | '.join(worst)[:600]}", flush=True)
cases = [("fmnist-cnn b256", "examples/models/fmnist-cnn.json", "bench/jobs/fmnist-cnn-bench.json", 256, 0.01, 51200,
          lambda: b.fmnist(51200, "/usr/share/datasets/fashion-mnist")),
         ("resnet-small b128", "examples/models/resnet-small-64.json", "bench/jobs/resnet-small-64-synthetic.json",
          128, 0.05, 0, lambda: b.synthetic(25600, (3, 64, 64)))]
b.torch.backends.cudnn.benchmark = True
for name, spec, job, batch, lr, limit, data in cases:
    x, y = data()
    rates = {t: [] for t in settings}
    for rnd in range(2):
        for t in settings:
            os.environ["PSTRAIN_CUDNN_TRANSFORMS"] = t
            rates[t].append(b.ours_rate(f"{binary_dir}/pstrain-worker", job, batch, limit, 4)[0])
    os.environ.pop("PSTRAIN_CUDNN_TRANSFORMS", None)  # The default, for the reference run.
    ref = b.torch_rate(spec, x, y, batch, lr, tf32=False, epochs=4)
    for t in settings:
        m = statistics.median(rates[t])
        print(f"transforms '{t}': {name} pstrain {m:.0f} samples/s ({', '.join(f'{v:.0f}' for v in rates[t])}), "
              f"PyTorch eager fp32 {ref:.0f}, ratio {m / ref:.2f}x", flush=True)
PY
}

PIDS=()
stop_cluster() {
  if ((${#PIDS[@]})); then kill -TERM "${PIDS[@]}" 2>/dev/null; wait "${PIDS[@]}" 2>/dev/null; fi
  PIDS=()
}
trap stop_cluster EXIT

stage_distributed() {
  local log=$OUT/distributed.log prom=$OUT/distributed-metrics.prom
  : >"$log"
  : >"$prom"
  for mode in ${DIST_MODES:-sync async}; do
    local port state
    port=$(free_port)
    state=$(mktemp -d)
    "$BIN/pstrain-server" --listen "127.0.0.1:$port" --state-dir "$state" >"$state/server.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do grep -q "listening on" "$state/server.log" && break; sleep 0.1; done
    local wports=()
    for w in 1 2; do
      local mp
      mp=$(free_port)
      wports+=("$mp")
      "$BIN/pstrain-worker" --server "127.0.0.1:$port" --device "$DEVICE" --metrics-port "$mp" \
        >"$state/worker$w.log" 2>&1 &
      PIDS+=($!)
    done
    for w in 1 2; do for _ in $(seq 100); do grep -q "registered" "$state/worker$w.log" && break; sleep 0.1; done; done
    local t0 t1 status
    t0=$(date +%s.%N)
    status=$(timeout 150 "$BIN/pstrain" --server "127.0.0.1:$port" --timeout-ms 30000 submit \
      examples/fashion-mnist.json --workers 2 --mode "$mode" --epochs "$EPOCHS" \
      ${DIST_PRECISION:+--precision "$DIST_PRECISION"} --watch --json 2>>"$log" | tail -1)
    t1=$(date +%s.%N)
    echo "== $mode: $status" >>"$log"
    for w in 1 2; do
      echo "# ---- $mode worker $w" >>"$prom"
      $PY -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:${wports[$((w-1))]}/metrics', timeout=5).read().decode())" \
        | grep -E '^pstrain_worker_(step_phase|gpu_)' >>"$prom"
    done
    stop_cluster
    for f in "$state"/*.log; do echo "-- $f" >>"$log"; tail -5 "$f" >>"$log"; done
    $PY - "$mode" "$status" "$t0" "$t1" "$prom" <<'PY' | tee -a "$SUMMARY"
import json, re, sys
mode, status, t0, t1, prom = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
try:
    s = json.loads(status)
    print(f"distributed {mode} ({s.get('spec', {}).get('precision', 'PRECISION_FP32')}): "
          f"state {s.get('state')} test accuracy {s.get('test', {}).get('accuracy')} "
          f"steps {s.get('step')} wall {t1 - t0:.1f}s")
except Exception as e:
    print(f"distributed {mode}: no status ({e}): {status[:300]}")
text = open(prom).read().split(f"# ---- {mode} worker 1")[-1]
for w, part in enumerate(re.split(r"# ---- \w+ worker \d\n", text)[:2], 1):
    sums = dict(re.findall(r'^pstrain_worker_step_phase_seconds_sum\{phase="(\w+)"\} (\S+)', part, re.M))
    counts = dict(re.findall(r'^pstrain_worker_step_phase_seconds_count\{phase="(\w+)"\} (\S+)', part, re.M))
    per = {k: 1000 * float(sums[k]) / max(float(counts.get(k, 0)), 1) for k in sums}
    print(f"distributed {mode} worker {w}: mean ms per step " +
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
PY
  done
}

stage_layers() {
  {
    timeout 120 "$BIN/gpu_layers_bench" --model examples/models/resnet-small-64.json --batch 128 \
      --reps "${LAYERS_REPS:-20}"
    echo "rc=$?"
    timeout 60 "$BIN/gpu_layers_bench" --model examples/models/fmnist-cnn.json --batch 256 \
      --reps "${LAYERS_REPS:-20}"
    echo "rc=$?"
  } >"$OUT/layers.log" 2>&1
  grep -E '^(fp32|bf16|fp16):|^rc=' "$OUT/layers.log" | sed 's/^/layers: /' | tee -a "$SUMMARY"
}

stage_integration() {
  timeout "${INTEGRATION_SECONDS:-150}" "$BIN/distributed_training_test" \
    --gtest_filter="${INTEGRATION_FILTER:-*PullCompressed*}" >"$OUT/integration.log" 2>&1
  say "integration: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/integration.log" | tr '\n' ' ')"
}

stage_cpuhost() {
  local log=$OUT/cpuhost.log rc=0 cores certs=$ROOT/devdata/certs
  if [[ ! -f $certs/ca.pem ]]; then  # Not from the bundle: make them (needs openssl).
    certs=$OUT/certs
    deploy/local/make-certs.sh "$certs" >/dev/null || { say "cpuhost: no certificates"; return 1; }
  fi
  {
    echo "== cpuhost $(date -u +%FT%TZ): $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
    for cores in ${CPUHOST_CORES:-0-1 0-3}; do
      for connections in ${CPUHOST_CONNECTIONS:-1 2}; do
        echo "== transport_bench --reps=${CPUHOST_REPS:-7} --tls_certs --connections=$connections, taskset -c $cores"
        taskset -c "$cores" timeout "${CPUHOST_TRANSPORT_SECONDS:-400}" "$BIN/transport_bench" \
          --reps="${CPUHOST_REPS:-7}" --tls_certs="$certs" --connections="$connections" || rc=1
      done
    done
    echo "== bench/train_cpu_vs_pytorch.py --rounds ${CPUHOST_ROUNDS:-3}, taskset -c 0-1"
    taskset -c 0-1 timeout "${CPUHOST_TRAIN_SECONDS:-600}" $PY bench/train_cpu_vs_pytorch.py \
      --rounds "${CPUHOST_ROUNDS:-3}" || rc=1
    for round in 1 2 3; do
      for width in 256 512; do
        echo "== cpu_ops_bench --layout=blocked --reps=40 --width=$width, taskset -c 0-1, round $round"
        taskset -c 0-1 timeout 120 "$BIN/cpu_ops_bench" --layout=blocked --reps=40 \
          --width="$width" || rc=1
      done
    done
  } >"$log" 2>&1
  say "cpuhost: $(sed -n 's/^== cpuhost [^ ]*: //p' "$log")"
  grep -E '^== (transport|cpu_ops)|GB/s|ratio|median|conv2|whole step' "$log" |
    tee -a "$SUMMARY" >/dev/null
  return $rc
}

stage_tlsnet() {
  local log=$OUT/tlsnet.log rc=0 path=$PATH libs=${LD_LIBRARY_PATH:-} certs=""
  [[ -f $ROOT/devdata/cluster-certs/ca.pem ]] && certs=$ROOT/devdata/cluster-certs  # Else openssl.
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    path=$ROOT/build/devtools/bin:$PATH
    libs=$ROOT/build/devtools/lib${libs:+:$libs}
  fi
  PATH=$path LD_LIBRARY_PATH=$libs CERTS_DIR=$certs \
    CORES_PER_HOST=${TLSNET_CORES_PER_HOST:-3} TLS_RATES=${TLSNET_RATES:-10gbit} \
    TLS_SIZES=${TLSNET_SIZES:-"1:1 2:2"} \
    WORKER_ARGS="--connections-per-shard=${TLSNET_CONNECTIONS:-2}" \
    PSTRAIN_BIN=$BIN PSTRAIN_BENCH_OUT=$OUT/tlsnet \
    timeout "${TLSNET_SECONDS:-480}" bench/cluster_emulation.sh tls >"$log" 2>&1 || rc=$?
  say "tlsnet: rc=$rc$( ((rc == 77)) && echo " (skipped: $(grep -m1 SKIP "$log"))")"
  grep -E '== tls|tls_cost|%$' "$log" | tee -a "$SUMMARY" >/dev/null
  return $rc
}

stage_ctest() {
  if ! command -v ctest >/dev/null; then say "ctest: not on this machine"; return 1; fi
  # CTEST_LIST: a file of test names, one per line, to run only those (the
  # rest of an earlier run that ran out of time).
  local only=()
  if [[ -n ${CTEST_LIST:-} ]]; then
    only=(-R "$($PY -c 'import re, sys; print("^(" + "|".join(re.escape(l.strip()) for l in open(sys.argv[1]) if l.strip()) + ")")' "$CTEST_LIST")")
  fi
  (cd build && OMP_NUM_THREADS=2 timeout "${CTEST_SECONDS:-300}" ctest -j12 --timeout 240 \
     -LE 'python|containers|deploy|bench' \
     -E 'tensorboard_reads_tfevents|grpc_health_and_reflection|prometheus_integration' \
     "${only[@]}" >"$OUT/ctest.log" 2>&1)
  say "ctest: rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
  sed -n '/The following tests/,$p' "$OUT/ctest.log" | head -30 >>"$SUMMARY"
}

for s in "${STAGES[@]}"; do
  echo "---- stage $s at $(elapsed)" >>"$SUMMARY"
  "stage_$s"
done
say "done in $(elapsed)"
