#!/usr/bin/env bash
# A/B of decode kernels in one build, by the FLASHKDA_DECODE_KERNEL dev switch (read on every call), in
# alternating rounds so that the machine's drift falls on every setting alike:
#   KERNELS="auto stream" CASES=4,6,8,10 ROUNDS=3 TESTS=1 SANITIZE=1 bash scripts/ab_decode_kernels.sh
# ("auto" unsets the switch.)  TESTS=1 first runs the decode and serving GPU tests, SANITIZE=1 memcheck and
# racecheck of scripts/sanitize_case.py.  Output: $OUT/ab_decode.log, $OUT/ab_decode_summary.md
# (scripts/ab_summary.py: median over rounds per case and kernel, each against the first, with % of copy
# bandwidth) and $OUT/ab_rounds.tar.gz holding each run's ab_<kernel>_r<round>.json / .log.
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ab_decode.log") 2>&1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
KERNELS=${KERNELS:-auto stream}
CASES=${CASES:-4,6,8,10}
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps . > /tmp/ab_decode_build.log 2>&1 ||
  { tail -40 /tmp/ab_decode_build.log; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/python/test_gpu_decode.py tests/python/test_gpu_serving.py \
    -q -x -p no:cacheprovider 2>&1 | tail -3
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_case.py 2>&1 |
      grep -E "plain stream|decode|SUMMARY" ; echo "$tool rc=${PIPESTATUS[0]}"
  done
fi
for r in $(seq 1 "$ROUNDS"); do
  for k in $KERNELS; do
    if [ "$k" = auto ]; then unset FLASHKDA_DECODE_KERNEL; else export FLASHKDA_DECODE_KERNEL=$k; fi
    python3 bench/bench_decode.py --no-fla --no-cold --cases "$CASES" --json "$OUT/ab_${k}_r$r.json" \
      > "$OUT/ab_${k}_r$r.log" 2>&1 || { echo "bench $k r$r failed"; tail -20 "$OUT/ab_${k}_r$r.log"; }
  done
done
unset FLASHKDA_DECODE_KERNEL
jsons=()
for r in $(seq 1 "$ROUNDS"); do for k in $KERNELS; do
  [ -f "$OUT/ab_${k}_r$r.json" ] && jsons+=("$OUT/ab_${k}_r$r.json")
done; done
# Medians over rounds, each kernel against the first of KERNELS (scripts/ab_summary.py, as ab_bench.sh)
[ ${#jsons[@]} -gt 0 ] && python3 scripts/ab_summary.py --base "${KERNELS%% *}" "${jsons[@]}" | tee "$OUT/ab_decode_summary.md"
# The device returns at most 8 files from $OUT: each run's JSON and log travel as one archive
# (PACK_ROUNDS=0 keeps them loose).
if [ "${PACK_ROUNDS:-1}" = 1 ] && ls "$OUT"/ab_*_r*.* > /dev/null 2>&1; then
  (cd "$OUT" && tar czf ab_rounds.tar.gz ab_*_r*.* && rm -f ab_*_r*.json ab_*_r*.log) || echo "packing the rounds failed"
fi
echo "total: $(( $(date +%s) - t0 )) s"
