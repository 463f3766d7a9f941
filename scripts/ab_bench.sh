#!/usr/bin/env bash
# A/B of kernel variants in one device call, timed in alternating rounds so that the machine's
# drift (copy bandwidth moved 4.06-4.21 TB/s between calls of one session) falls on every variant alike.
#
# Variants are overlay folders under ab/ (untracked: they travel with the tree to the device), each
# mirroring repository paths, e.g. ab/old_walk/csrc/sm90/kda_state_recurrence.cuh (make one from a
# commit with scripts/ab_overlay.sh), or committed patches: a variant <v> without ab/<v> is
# experiments/<v>.patch applied to its copy of the tree (the whole tree: its tests change with it).
# "base" is the tree itself.  Each variant is built from its own copy of the tree into its own
# --target folder, then bench/bench_prefill.py or bench/bench_decode.py (BENCH=prefill | decode;
# ours only) runs once per variant per round in a fresh process (two builds of the extension cannot
# share one process).  CASES are the benchmark's own --cases; with PREFILL_VARIANTS=1, VARIANT_CASES
# (bench_prefill's --variant-cases, default 0,3) picks the cases of the serving-variant rows.
# TESTS=1 first runs each variant's own GPU tests (PYTEST_PATHS, from the variant's copy, against its
# build; a variant whose tests fail is dropped from the timed rounds), so that one call can check and
# time prepared changes (base, main itself, is not tested again unless TEST_BASE=1):
#   TESTS=1 PYTEST_PATHS="tests/python/test_gpu.py" VARIANTS="walk-u" ROUNDS=2 bash scripts/ab_bench.sh
# With wheels under .whl/ (carried: pip download --no-deps -d .whl -r requirements-fla.txt) the tests
# also see fla (installed into /tmp/ab_fla), so the GPU tests of flashkda.fla_backend run; the timed
# rounds never import it.
# SANITIZE_VARIANTS (a subset of VARIANTS) adds memcheck and racecheck of sanitize_case.py per variant.
#   FLASHKDA_COMMIT=<sha of the tree> VARIANTS="old_walk" CASES=0,3 ROUNDS=3 ITERS=30 bash scripts/ab_bench.sh
# (FLASHKDA_COMMIT goes into each JSON's meta.commit, "+ab/<variant>" for the overlays; without it
# the commit reads "unknown": the device copy's git metadata can be stale.)
#   BENCH=decode VARIANTS="old_decode" CASES=... ROUNDS=3 bash scripts/ab_bench.sh
# Output: $OUT/ab.log, $OUT/ab_summary.md (medians over rounds, per kernel, and each variant against
# base) and $OUT/ab_rounds.tar.gz holding each run's ab_<variant>_r<round>.json (PACK_ROUNDS=0: loose).
# Cost: ~30 s of build per variant, ~10 s per run and case.
set -uo pipefail
ROOT=$(pwd)
OUT=${OUT:-/tmp/flashkda_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ab.log") 2>&1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
VARIANTS=${VARIANTS:-$(ls ab 2>/dev/null | tr '\n' ' ')}
BENCH=${BENCH:-prefill}
CASES=${CASES:-$([ "$BENCH" = prefill ] && echo 0,3)}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-30}
names="base $VARIANTS"
echo "$BENCH variants: $names; cases ${CASES:-all}; $ROUNDS rounds of $ITERS graph replays"
# PLAN=1: print the call's expected duration and exit, to keep a device call under its 600 s limit
# (one call of 2026-12-05 ran out and took the session's remaining device time).  Fitted to the logs of
# docs/runs/2026-12-05e (qt-six-warps: 132 s, pool-row-late: 149 s): ~17 s of build a variant, ~20 s of
# GPU tests, ~15 s a sanitizer tool, and a timed process ~5 s + ~3 s a case (ITERS=30); cases "all"
# counted as 10.
if [ "${PLAN:-0}" = 1 ]; then
  nv=$(echo $names | wc -w)
  ncase=$( [ -n "$CASES" ] && echo "$CASES" | tr ',' '\n' | grep -c . || echo 10)
  ntest=0
  if [ "${TESTS:-0}" = 1 ]; then
    ntest=$(( nv - 1 )); [ "${TEST_BASE:-0}" = 1 ] && ntest=$nv
    [ -n "${TEST_VARIANTS:-}" ] && ntest=$(echo $TEST_VARIANTS | wc -w)
  fi
  nsan=$(echo ${SANITIZE_VARIANTS:-} | wc -w)
  est=$(( 17 * nv + 20 * ntest + 30 * nsan + ROUNDS * nv * (5 + 3 * ncase * ITERS / 30) ))
  echo "plan: $nv builds, $ntest test runs, $nsan x 2 sanitizer runs, $ROUNDS x $nv x $ncase timed runs: ~${est} s"
  if [ "$est" -gt 480 ]; then echo "plan: over 480 s: split the variants over two calls"; fi
  exit 0
fi
t0=$(date +%s)
for v in $names; do
  if [ "$v" != base ] && [ ! -d "ab/$v" ] && [ ! -f "experiments/$v.patch" ]; then
    echo "no overlay folder ab/$v and no experiments/$v.patch"; exit 2
  fi
  src=/tmp/ab_src/$v
  rm -rf "$src" "/tmp/ab_site/$v" && mkdir -p "$src"
  tar --exclude=./ab --exclude=./build --exclude=./.cache --exclude=./.whl -cf - . | tar -xf - -C "$src"
  if [ "$v" != base ] && [ -d "ab/$v" ]; then
    cp -r "ab/$v/." "$src/"
  elif [ "$v" != base ]; then
    if ! (cd "$src" && git apply --whitespace=nowarn "$ROOT/experiments/$v.patch"); then
      echo "experiments/$v.patch does not apply to this tree"; exit 2
    fi
  fi
  if ! (cd "$src" && python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/ab_site/$v" . \
        > "/tmp/ab_build_$v.log" 2>&1); then
    echo "build of $v failed:"; tail -40 "/tmp/ab_build_$v.log"; exit 1
  fi
  echo "built $v: $(( $(date +%s) - t0 )) s"
done
if [ "${TESTS:-0}" = 1 ]; then
  fla_path=""
  if ls .whl/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/ab_fla
    if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ab_fla .whl/*.whl; then
      fla_path=":/tmp/ab_fla"; echo "tests see fla from .whl/: $(ls .whl | tr '\n' ' ')"
    fi
  fi
  kept=""
  for v in $names; do
    # base is main as it stands, tested on its own (TEST_BASE=1 tests it here too)
    if [ "$v" = base ] && [ "${TEST_BASE:-0}" != 1 ]; then kept="$kept $v"; continue; fi
    # TEST_VARIANTS (default: every variant) limits the tests to the variants named there
    if [ -n "${TEST_VARIANTS:-}" ] && [[ " $TEST_VARIANTS " != *" $v "* ]]; then kept="$kept $v"; continue; fi
    echo "== GPU tests of $v (${PYTEST_PATHS:-tests/python/test_gpu.py})"
    if (cd "/tmp/ab_src/$v" && PYTHONPATH="/tmp/ab_site/$v:/tmp/ab_src/$v/tests/python$fla_path" \
          timeout "${PYTEST_TIMEOUT:-300}" \
          python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/python/test_gpu.py} -q -x --maxfail=3 -p no:cacheprovider 2>&1 | tail -15); then
      kept="$kept $v"
    else
      echo "GPU tests of $v FAILED: dropped from the timed rounds"
    fi
  done
  names=$kept
fi
# SANITIZE_VARIANTS="<v> ...": compute-sanitizer memcheck and racecheck of scripts/sanitize_case.py against
# each named variant's own build (its H = 2 walks are the 4-warp kind), e.g. for the patch about to land.
for v in ${SANITIZE_VARIANTS:-}; do
  for tool in memcheck racecheck; do
    echo "== $tool of $v (scripts/sanitize_case.py)"
    (cd "/tmp/ab_src/$v" && PYTHONPATH="/tmp/ab_site/$v" timeout "${SANITIZE_TIMEOUT:-150}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 scripts/sanitize_case.py 2>&1 | tail -4)
    echo "$tool of $v rc=$?"
  done
done
# PROFILE_CASE=<bench case> [PROFILE_KERNELS="<regex> ..."] [PROFILE_VARIANTS=<names>]: per variant,
# scripts/profile_prefill_source.sh against that variant's build (Nsight Compute source-level stall
# samples, summarised per instruction and phase), its log and reports under $OUT/prof_<variant>/.
if [ -n "${PROFILE_CASE:-}" ]; then
  for v in ${PROFILE_VARIANTS:-$names}; do
    echo "== profile of $v (case $PROFILE_CASE)"
    (cd "/tmp/ab_src/$v" && PYTHONPATH="/tmp/ab_site/$v" SKIP_BUILD=1 CASE="$PROFILE_CASE" \
      KERNELS="${PROFILE_KERNELS:-state_recurrence}" OUT="$OUT/prof_$v" bash scripts/profile_prefill_source.sh > /dev/null 2>&1)
    grep -v "^total" "$OUT/prof_$v/profile_prefill.log" | head -60
  done
fi
# TIMED_VARIANTS (default: base and every variant) limits the timed rounds.
for r in $(seq 1 "$ROUNDS"); do
  for v in ${TIMED_VARIANTS:-$names}; do
    if [ "$BENCH" = prefill ]; then
      # PREFILL_VARIANTS=1 also times the serving variants (pool addressing, bf16 state, checkpoints)
      cmd=(bench/bench_prefill.py --no-fla --iters "$ITERS" ${CASES:+--cases "$CASES"})
      [ "${PREFILL_VARIANTS:-0}" = 1 ] || cmd+=(--no-variants)
      if [ -n "${VARIANT_CASES:-}" ]; then cmd+=(--variant-cases "$VARIANT_CASES"); fi  # the serving variants' cases
    else
      cmd=(bench/bench_decode.py --no-fla --no-cold --iters "$ITERS" ${CASES:+--cases "$CASES"})
    fi
    # The JSON's commit names the tree and the overlay (the device copy's git metadata can be stale).
    tag="${FLASHKDA_COMMIT:-unknown}"; [ "$v" != base ] && tag="$tag+ab/$v"
    if ! FLASHKDA_COMMIT="$tag" PYTHONPATH="/tmp/ab_site/$v${PYTHONPATH:+:$PYTHONPATH}" python3 "${cmd[@]}" --json "$OUT/ab_${v}_r$r.json" \
        > /tmp/ab_run.log 2>&1; then
      echo "run $v round $r failed:"; tail -20 /tmp/ab_run.log
    fi
    grep -E "ours|fp32 state" /tmp/ab_run.log | grep -v "per kernel" | sed "s/^/[$v r$r] /"
  done
done
if ls "$OUT"/ab_*_r*.json > /dev/null 2>&1; then
  # SUMMARY_RATIO=<pattern> (e.g. chunk_prepare) adds ab_summary.py's --ratio table of those kernels.
  python3 scripts/ab_summary.py ${SUMMARY_RATIO:+--ratio "$SUMMARY_RATIO"} "$OUT"/ab_*_r*.json | tee "$OUT/ab_summary.md"
  # The device returns at most 8 files from $OUT: the rounds' JSONs travel as one archive
  # (ab_rounds.tar.gz; `tar xzf` it and run ab_summary.py on them again).  PACK_ROUNDS=0 keeps them loose.
  if [ "${PACK_ROUNDS:-1}" = 1 ]; then
    (cd "$OUT" && tar czf ab_rounds.tar.gz ab_*_r*.json && rm -f ab_*_r*.json) || echo "packing the rounds failed"
  fi
else
  echo "no timed runs (no GPU, or ROUNDS=0)"
fi
echo "total: $(( $(date +%s) - t0 )) s"
