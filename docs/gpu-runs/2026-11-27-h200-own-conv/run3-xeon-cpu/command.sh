mkdir -p /tmp/c build/bin /usr/share/datasets && tar -xJf .devcarry/cpu.tar.xz -C /tmp/c && cp -r /tmp/c/data/fashion-mnist /usr/share/datasets/ && cp /tmp/c/bin/* build/bin/
export LD_LIBRARY_PATH=/tmp/c/lib
lscpu > $OUT/lscpu.txt
taskset -c 0-1 python3 bench/train_cpu_vs_pytorch.py --rounds 3 > $OUT/train.log 2>&1
W="build/bin/pstrain-worker --standalone bench/jobs/fmnist-cnn-bench.json --device cpu --batch 64 --checkpoint none"
ONEDNN_VERBOSE=1 taskset -c 0-1 $W --limit 3200 2>&1 | grep '^onednn_verbose,.*exec' | awk -F, '{k=$4","$5","$6","$(NF-1); t[k]+=$NF; c[k]++} END{for(k in t) printf "%10.1f %6d %s\n", t[k], c[k], k}' | sort -rn | head -40 > $OUT/onednn.txt
P="env LD_LIBRARY_PATH=/tmp/c/perf/lib:/tmp/c/lib /tmp/c/perf/perf"
ONEDNN_JIT_PROFILE=1 taskset -c 0-1 $P record -e cpu-clock -F 499 -g -o /tmp/perf.data -- $W --limit 12800 > $OUT/perf-run.log 2>&1
$P report -i /tmp/perf.data --no-children --sort dso,sym --stdio -g none 2>&1 | head -70 > $OUT/perf-report.txt
taskset -c 0-1 timeout 150 build/bin/transport_bench --reps=5 > $OUT/transport.log 2>&1
tail -4 $OUT/train.log; head -25 $OUT/onednn.txt; grep -v '^#' $OUT/perf-report.txt | head -30; tail -8 $OUT/transport.log
