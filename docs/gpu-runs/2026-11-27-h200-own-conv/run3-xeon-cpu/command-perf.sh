mkdir -p /tmp/c build/bin /usr/share/datasets && tar -xJf .devcarry/cpu.tar.xz -C /tmp/c && cp -r /tmp/c/data/fashion-mnist /usr/share/datasets/ && cp /tmp/c/bin/* build/bin/
export LD_LIBRARY_PATH=/tmp/c/lib
W="build/bin/pstrain-worker --standalone bench/jobs/fmnist-cnn-bench.json --device cpu --batch 64 --checkpoint none"
P="env LD_LIBRARY_PATH=/tmp/c/perf/lib:/tmp/c/lib /tmp/c/perf/perf"
taskset -c 0-1 $P record -e cpu-clock -F 999 -o $OUT/perf.data -- $W --limit 12800 > $OUT/perf-run.log 2>&1
$P buildid-list -i $OUT/perf.data > $OUT/buildids.txt 2>&1
$P report -i $OUT/perf.data --sort dso --stdio 2>&1 | grep -v '^#' | head -20
ls -la $OUT; pwd
