"""Probe: is a many-request decode call's time set by its rounds of work items (perf-notes v33)?

The pipelined decode kernel (fp32 spec calls) deals (request, head, 32-row slice) items round-robin over
G = 2 x SMs blocks, and each block's consumers run one item at a time; the plain stream kernel deals the
same items over its state blocks.  If the call is ceil(items / G) rounds of one item a block, its time is a
staircase in N: flat while the round count stays, a step of one round's time where it grows.  A time
linear in N (a per-request cost plus a fixed one) says the opposite.  This times one kind of call (spec 1+3
or plain, fp32 or bf16 pool) at a list of N with CUDA-graph replays (bench_decode's case and timing) and
prints, beside each time, the items, the rounds of the pipelined kernel's grid and time / rounds (plain
fixed-layout calls run the plain stream kernel by default, whose grid differs: for the same reading of
plain calls, force the pipelined kernel with FLASHKDA_DECODE_KERNEL=pipelined).

    python3 bench/probe_decode_rounds.py --mode spec --Ns 56,60,64,66,68,72,80 --json out.json
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import bench_prefill as bp  # noqa: E402
from flashkda.timing import cuda_graph_times_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("spec", "plain"), default="spec")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--Ns", default="56,60,64,66,68,72,80", help="comma-separated request counts")
    ap.add_argument("--H", type=int, default=bd.H_DEFAULT)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    spec = args.mode == "spec"
    T = 1 + bd.NUM_SPEC if spec else 1
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = 2 * sms  # the pipelined kernel's blocks (kDecodeBlocksPerSm = 2)
    slices = bd.D // 32
    copy_bw = bp.copy_bandwidth()  # bytes / s, read + write, measured here
    rows = []
    for N in (int(n) for n in args.Ns.split(",")):
        x = bd.make_case(N, T, spec, dtype, args.H, seed=N)
        fn = bd.Ours(x)
        times = cuda_graph_times_us(fn, args.iters, calls_per_graph=bd.CALLS_PER_GRAPH)
        us = statistics.median(times)
        items = N * args.H * slices
        rounds = math.ceil(items / grid)
        floor_us = bd.decode_floor_bytes(N, T, args.H, bd.D, dtype.itemsize, spec) / copy_bw * 1e6
        r = dict(N=N, us=us, items=items, rounds=rounds, work_rounds=items / grid, us_per_round=us / rounds,
                 floor_us=floor_us, pct_copy_bw=100 * floor_us / us)
        rows.append(r)
        print(f"N={N:4d}  {us:8.1f} us  items {items:6d}  rounds {rounds:3d} ({r['work_rounds']:6.2f} of work)"
              f"  {r['us_per_round']:6.2f} us a round  {r['pct_copy_bw']:5.1f}% of copy BW", flush=True)
    meta = bp.run_meta()
    meta.update(mode=args.mode, dtype=args.dtype, H=args.H, grid=grid, copy_bandwidth_TBps=copy_bw / 1e12,
                kernel=os.environ.get("FLASHKDA_DECODE_KERNEL", "auto"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
