#!/usr/bin/env bash
# Nsight Compute profiles of the decode kernel with source-level (SASS) stall sampling, for finding
# where a decode item's time goes.  One device call: builds, then per case (N T pool impl) a report
# plus its details page and its per-instruction source page (csv); everything in $OUT/prof.tgz.
#   CASES="256 1 fp32 ours;1 1 fp32 ours" bash scripts/profile_decode_source.sh
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}
P=/tmp/prof
mkdir -p "$OUT" "$P"
exec > >(tee -a "$OUT/profile.log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then  # SKIP_BUILD=1 after scripts/gpu_run.sh in the same call
  python3 -m pip install --no-build-isolation --no-deps . > "$P/build.log" 2>&1 || { tail -60 "$P/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
IFS=';' read -ra cases <<< "${CASES:-256 1 fp32 ours;1 1 fp32 ours;1 1 fp32 fla;256 4 fp32 ours}"
for c in "${cases[@]}"; do
  tag=$(echo $c | tr ' ' '_')
  ncu --cache-control none --clock-control none -k regex:"decode|fused_recurrent" -s 2 -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
    --section Occupancy --section SourceCounters --import-source yes -f -o "$P/$tag" \
    python3 scripts/profile_decode.py $c > "$P/${tag}_run.txt" 2>&1
  ncu -i "$P/$tag.ncu-rep" --page details > "$P/${tag}_details.txt" 2>&1
  ncu -i "$P/$tag.ncu-rep" --page source --csv --print-source sass > "$P/${tag}_sass.csv" 2>&1
  grep -E "Duration|Elapsed Cycles|Issued Warp|No Eligible|Warp Cycles Per Issued" "$P/${tag}_details.txt" | sed "s/^/$tag: /"
  python3 scripts/ncu_source_summary.py "$P/${tag}_sass.csv" --top 12 | sed "s/^/$tag: /"
done
tar czf "$OUT/prof.tgz" -C /tmp prof
echo "total: $(( $(date +%s) - t0 )) s"
