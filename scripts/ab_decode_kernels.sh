#!/usr/bin/env bash
# A/B of decode kernels in one build, by the FLASHKDA_DECODE_KERNEL dev switch (read on every call), in
# alternating rounds so that the machine's drift falls on every setting alike:
#   KERNELS="auto stream" CASES=4,6,8,10 ROUNDS=3 TESTS=1 SANITIZE=1 bash scripts/ab_decode_kernels.sh
# ("auto" unsets the switch.)  TESTS=1 first runs the decode and serving GPU tests, SANITIZE=1 memcheck and
# racecheck of scripts/sanitize_case.py.  Output: $OUT/ab_decode.log, $OUT/dec_<kernel>_r<round>.json and
# $OUT/ab_decode_summary.md (median over rounds per case and kernel, and each against the first).
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
    python3 bench/bench_decode.py --no-fla --no-cold --cases "$CASES" --json "$OUT/dec_${k}_r$r.json" \
      > "$OUT/dec_${k}_r$r.log" 2>&1 || { echo "bench $k r$r failed"; tail -20 "$OUT/dec_${k}_r$r.log"; }
  done
done
unset FLASHKDA_DECODE_KERNEL
python3 - "$OUT" "$ROUNDS" $KERNELS <<'PY'
import json, statistics, sys
out, rounds, kernels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = {}
for k in kernels:
    for r in range(1, rounds + 1):
        try:
            js = json.load(open(f"{out}/dec_{k}_r{r}.json"))
        except OSError:
            continue
        for c in js["decode"]:
            res.setdefault(c["case"], {}).setdefault(k, []).append((c["ours_us"], c.get("pct_copy_bw")))
lines = ["| case | kernel | rounds | us (median) | % copy BW | vs " + kernels[0] + " |", "|---|---|---|---|---|---|"]
for case, per in res.items():
    base = statistics.median(t for t, _ in per[kernels[0]]) if kernels[0] in per else None
    for k in kernels:
        if k not in per:
            continue
        t = statistics.median(x for x, _ in per[k])
        bw = [p for _, p in per[k] if p is not None]
        pct = f"{statistics.median(bw):.1f}" if bw else "-"
        rel = f"{100 * (t / base - 1):+.2f}%" if base and k != kernels[0] else "-"
        lines.append(f"| {case} | {k} | {len(per[k])} | {t:.1f} | {pct} | {rel} |")
open(f"{out}/ab_decode_summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "total: $(( $(date +%s) - t0 )) s"
