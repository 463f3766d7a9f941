#!/usr/bin/env bash
# Nsight Compute profiles of the prefill kernels with source-level stall sampling, for finding
# which phase of a kernel the time goes to.  One device call: builds (unless SKIP_BUILD=1), then per
# kernel a report, its details page and its per-instruction page (sass csv), summarised per
# instruction and per barrier-delimited phase (ncu_source_summary.py --phases); everything in
# $OUT/prof_prefill.tgz.
#   KERNELS="chunk_prepare state_recurrence" CASE=0 bash scripts/profile_prefill_source.sh
# CASE indexes bench/bench_prefill.py CASES (0: 8x2048 H16).
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}
P=/tmp/prof_prefill
mkdir -p "$OUT" "$P"
exec > >(tee -a "$OUT/profile_prefill.log") 2>&1
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps . > "$P/build.log" 2>&1 || { tail -60 "$P/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
for k in ${KERNELS:-chunk_prepare state_recurrence}; do
  tag="${k}_case${CASE:-0}"
  ncu --clock-control none -k regex:"$k" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters --import-source yes \
    -f -o "$P/$tag" python3 scripts/profile_case.py "${CASE:-0}" > "$P/${tag}_run.txt" 2>&1
  ncu -i "$P/$tag.ncu-rep" --page details > "$P/${tag}_details.txt" 2>&1
  ncu -i "$P/$tag.ncu-rep" --page source --csv --print-source sass > "$P/${tag}_sass.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|Issued Warp|No Eligible|Warp Cycles Per Issued|Registers|Achieved Occ" \
    "$P/${tag}_details.txt" | sed "s/^/$tag: /"
  cycles=$(grep -m1 "Elapsed Cycles" "$P/${tag}_details.txt" | awk '{print $NF}' | tr -d ,)
  python3 scripts/ncu_source_summary.py "$P/${tag}_sass.csv" --top 15 --phases ${cycles:+--pipes "$cycles"} \
    | sed "s/^/$tag: /"
done
tar czf "$OUT/prof_prefill.tgz" -C /tmp prof_prefill
echo "total: $(( $(date +%s) - t0 )) s"
