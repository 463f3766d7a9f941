#!/usr/bin/env bash
# One device call: build FlashKDA on the GPU machine, check it (record decoder, GPU pytest suite,
# compute-sanitizer) and benchmark it against fla.  Everything goes to $OUT/run.log; the benchmark
# JSON/markdown and the Triton autotune cache (for the next call) go beside it:
#   $OUT/bench.json, $OUT/benchmarks.md               prefill (bench/bench_prefill.py) -> docs/benchmarks.{json,md}
#   $OUT/bench_decode.json, $OUT/bench_decode.md      decode / spec decode (bench/bench_decode.py)
#                                                     -> docs/benchmarks-decode.{json,md}
#   MODE=quick  build + debug + GPU tests + sanitizer + prefill bench without fla + decode bench --quick
#               (with fla when importable: its fused_recurrent kernel compiles in seconds, no autotune)
#   MODE=full   the same with fla in the prefill benchmark and full repetitions (default)
#   BENCHES="prefill decode" (default) selects the benchmarks; PYTEST_PATHS (default tests/python)
#               narrows the GPU tests, e.g. PYTEST_PATHS=tests/python/test_gpu_decode.py BENCHES=decode
#   TESTS=0     skips the record decoder and the GPU tests (benchmark-only calls)
#   NCU=1       also Nsight Compute sections of both kernels; SANITIZE=0 skips compute-sanitizer
#   DECODE_NCU=1  Nsight Compute sections of the decode kernel (N=256 plain and spec 1+3, fp32 pool)
#   BW_CEILING=1  bench/bw_ceiling.cu: copy bandwidth vs. the decode pattern (16 KB slices read and
#               written back in place at random pool rows) without any math, by loads/stores and by
#               TMA; bench/latency_floor.cu: the per-launch floor of a batch-1 call in a graph
#   PROBES="cp_segments state_dtype"  also bench/probe_cp_segments.py (context parallelism's segment length
#               forced around the automatic plan) and bench/bench_state_dtype.py (bf16 vs fp32 state, pool vs
#               contiguous, interleaved): $OUT/cp_segments.json, $OUT/state_dtype.json;
#               PROBES=sm_partition: bench/probe_sm_partition.py (chunk_prepare and the walk on disjoint SM
#               sets through green contexts): $OUT/sm_partition.json;
#               PROBES=decode_load_policy: bench/probe_decode_switch.py (spec 1+3 over N, fp32 and bf16
#               pools, the pipelined kernel's two state-load L2 policies in rounds): $OUT/decode_load_policy.json;
#               PROBES=decode_switch: the same probe over DECODE_SWITCH="FLASHKDA_<NAME>=v1,v2,..." with
#               DECODE_SWITCH_ARGS (e.g. "--dtypes fp32 --Ns 64,256"): $OUT/decode_switch.json
#   DECODE_VARIANTS="FLASHKDA_DECODE_KERNEL=pipelined FLASHKDA_DECODE_PDL=0" also runs the decode
#               benchmark (without fla) once per VAR=VALUE setting: bench_decode_<var>_<value>.json
# Usage from the device tool (the device copy of the tree has no usable git history, so pass the
# commit in): FLASHKDA_COMMIT=<sha> MODE=full bash scripts/gpu_run.sh, carrying .whl (fla-core and
# its pure-Python deps as wheels) and, to skip fla's ~90 s autotune per head count, .cache with the
# triton_cache.tgz.part* files a previous run left under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/flashkda_out}
MODE=${MODE:-full}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache CMAKE_BUILD_PARALLEL_LEVEL=16
# The device copy of the tree may have no usable git history: pass the commit in (FLASHKDA_COMMIT).
[ -n "${FLASHKDA_COMMIT:-}" ] || echo "warning: FLASHKDA_COMMIT is not set; the JSON's commit comes from the device copy's git metadata, which can be stale"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if ls .cache/triton_cache.tgz.part* >/dev/null 2>&1; then cat .cache/triton_cache.tgz.part* | tar xzf - -C /tmp; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
date -u
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps . > /tmp/build.log 2>&1 || { tail -60 /tmp/build.log; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${TESTS:-1}" = 1 ]; then
  # Bounded, so that a kernel that hangs (an mbarrier that never completes) costs 2 minutes, not the call.
  timeout 120 python3 scripts/debug_records.py --T 130 --H 2 || echo "debug_records rc=$?"
  timeout 120 python3 scripts/debug_records.py --T 200 --H 1 --gate softplus || echo "debug_records rc=$?"
  timeout 120 python3 scripts/debug_records.py --T 100 --H 1 --D 64 || echo "debug_records rc=$?"
  # -m gpu: tests/python/test_gpu.py (prefill) and tests/python/test_gpu_decode.py (decode) among others
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/python} -q -x --maxfail=3 -p no:cacheprovider ${PYTEST_ARGS:-}
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_case.py; echo "memcheck rc=$?"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitize_case.py; echo "racecheck rc=$?"
fi
if [ "${NCU:-0}" = 1 ]; then
  ncu --clock-control none -k regex:chunk_prepare -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis python3 scripts/profile_case.py 0 2>&1 | tail -120
  ncu --clock-control none -k regex:state_recurrence -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats python3 scripts/profile_case.py 2 2>&1 | tail -80
fi
if [ "${DECODE_NCU:-0}" = 1 ]; then  # the decode kernel at N=256 (plain, then spec 1+3), fp32 pool
  for t in 1 4; do
    ncu --clock-control none -k regex:decode -s 2 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section WarpStateStats --section SchedulerStats python3 scripts/profile_decode.py 256 $t 2>&1 | tail -90
  done
fi
if [ "${BW_CEILING:-0}" = 1 ]; then  # the decode access pattern's own ceilings (no KDA math)
  nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/bw_ceiling.cu -o /tmp/bw_ceiling &&
    /tmp/bw_ceiling 256 && /tmp/bw_ceiling 64
  nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude -Icsrc --expt-relaxed-constexpr \
    bench/latency_floor.cu -o /tmp/latency_floor &&
    /tmp/latency_floor
fi
BENCHES=" ${BENCHES:-prefill decode} "
if [[ "$BENCHES" == *" prefill "* ]]; then
  BARGS=""
  [ "$MODE" = quick ] && BARGS="--no-fla"
  python3 bench/bench_prefill.py --json "$OUT/bench.json" --md "$OUT/benchmarks.md" $BARGS ${BENCH_ARGS:-}
fi
if [[ "$BENCHES" == *" decode "* ]]; then
  DARGS=""
  [ "$MODE" = quick ] && DARGS="--quick"
  python3 bench/bench_decode.py --json "$OUT/bench_decode.json" --md "$OUT/bench_decode.md" $DARGS ${DECODE_BENCH_ARGS:-}
  for var in ${DECODE_VARIANTS:-}; do  # e.g. FLASHKDA_DECODE_KERNEL=pipelined: A/B of decode variants
    tag=$(echo "$var" | tr 'A-Z=' 'a-z_')
    env "$var" python3 bench/bench_decode.py --json "$OUT/bench_decode_$tag.json" --md "$OUT/bench_decode_$tag.md" \
      --no-fla $DARGS ${DECODE_BENCH_ARGS:-}
  done
fi
for probe in ${PROBES:-}; do
  case "$probe" in
    cp_segments) python3 bench/probe_cp_segments.py --json "$OUT/cp_segments.json" ;;
    state_dtype) python3 bench/bench_state_dtype.py --rounds "${STATE_DTYPE_ROUNDS:-5}" --json "$OUT/state_dtype.json" ;;
    sm_partition) python3 bench/probe_sm_partition.py --json "$OUT/sm_partition.json" ;;
    decode_load_policy) python3 bench/probe_decode_switch.py --json "$OUT/decode_load_policy.json" ;;
    decode_switch) python3 bench/probe_decode_switch.py --switch "${DECODE_SWITCH:-}" ${DECODE_SWITCH_ARGS:-} \
      --json "$OUT/decode_switch.json" ;;
    *) echo "unknown probe: $probe (expected cp_segments, state_dtype, sm_partition, decode_load_policy or decode_switch)" ;;
  esac
done
if [ -d /tmp/triton_cache ]; then tar czf - -C /tmp triton_cache | split -b 15M - "$OUT/triton_cache.tgz.part"; fi
echo "total: $(( $(date +%s) - t0 )) s"
