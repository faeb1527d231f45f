#!/usr/bin/env bash
# bench/cluster_emulation.sh smoke (N = 2 workers, S = 2 shards, a few steps
# over tbf-limited veth links between network namespaces) runs end to end
# and prints its table: a header and one row for N=2 S=2, with a step time,
# link bytes and a bound, and "bench_only_fixed_compute_ms=" on every line
# it prints, and the servers' barrier waits (their /metrics); with
# TRACE_S=2, worker 1's packet trace (bench/link_trace.py) reports its push
# and pull per step. No timing is asserted. Exit 77 (skipped) passes through when the
# machine cannot make network namespaces (not root, no iproute2, no tbf).
#   tests/bench/cluster_emulation_smoke_test.sh BIN_DIR SOURCE_DIR
set -uo pipefail
BIN=$1
SRC=$2
OUT=$(mktemp -d /tmp/cluster-emulation-smoke.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
PSTRAIN_BIN=$BIN PSTRAIN_BENCH_OUT=$OUT/bench TRACE_S=2 timeout 150 bash "$SRC/bench/cluster_emulation.sh" \
  smoke >"$OUT/stdout" 2>"$OUT/stderr"
rc=$?
cat "$OUT/stdout"
if ((rc == 77)); then
  cat "$OUT/stderr"
  exit 77
fi
fail() {
  echo "FAIL: $*"
  echo "--- stderr"
  tail -30 "$OUT/stderr"
  for f in "$OUT"/bench/run.*/cluster.*/*.log; do [[ -f $f ]] && { echo "--- $f"; tail -15 "$f"; }; done
  exit 1
}
((rc == 0)) || fail "cluster_emulation.sh smoke exited $rc"
[[ -s $OUT/stdout ]] || fail "no output"
# Every line printed carries the bench-only flag.
if grep -v -e '^$' "$OUT/stdout" | grep -v -q 'bench_only_fixed_compute_ms='; then
  fail "a line without bench_only_fixed_compute_ms=: $(grep -v -e '^$' "$OUT/stdout" | grep -v 'bench_only_fixed_compute_ms=' | head -1)"
fi
grep -q $'step_ms_median' "$OUT/stdout" || fail "no table header"
# The row: flag, N=2, S=2, codec none, plaintext, a positive step time and bound.
python3 - "$OUT/stdout" <<'PY' || fail "no valid N=2 S=2 row"
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
rows = [r for r in rows if len(r) >= 22 and r[1] == "2" and r[2] == "2"]
assert len(rows) == 1, rows
r = rows[0]
assert r[0].startswith("bench_only_fixed_compute_ms=") and int(r[0].split("=")[1]) > 0, r
assert r[3] == "none" and r[4] == "plain", r
assert int(r[7]) >= 3, r                                     # steps measured
assert float(r[8]) > 0 and float(r[14]) > 0 and float(r[16]) > 0, r  # step time, bounds
assert float(r[10]) > 1.0 and float(r[12]) > 1.0, r          # MB per step pushed, received
# Barrier waits from the servers' /metrics: every chunk completes one a step.
assert float(r[20]) >= 0 and float(r[21]) >= 1, r
print("row ok:", "\t".join(r))
PY
# The trace's summary: whole steps, each with a push and a pull of bytes.
python3 - "$OUT/stdout" <<'PY' || fail "no valid link_trace summary"
import re, sys
lines = [l for l in open(sys.argv[1]) if "link_trace: median of" in l]
assert len(lines) == 1, lines
m = re.search(r"median of (\d+) steps: push_ms (\d+) link_ms (\d+) .* flows_ms (\d+)/(\d+)/(\d+) "
              r"pull_after_ms (-?\d+) pull_ms (\d+) pull_link_ms (\d+)", lines[0])
assert m, lines[0]
steps, push_ms, link_ms, first, median, last, after, pull_ms, pull_link_ms = map(int, m.groups())
assert steps >= 1 and link_ms > 0 and pull_link_ms > 0, lines[0]
assert 0 <= first <= median <= last <= push_ms and push_ms > 0, lines[0]
assert lines[0].startswith("bench_only_fixed_compute_ms="), lines[0]
print("trace ok:", lines[0].strip())
PY
echo "cluster_emulation smoke: ok"
