"""Probe: where does the pipelined decode kernel's evict-first state-load policy help (perf-notes v39)?

The pipelined kernel (fp32 spec calls) can load its state slices with an L2 evict-first policy
(DecodeArgs.load_evict_first; dev switch FLASHKDA_DECODE_LOAD_POLICY=evict_first | normal, read at every
call, so one process can time both).  On the H200 it measured -2.3% at spec 1+3 N = 64 and +0.6% at N = 256
(fp32 pool).  This times spec 1+3 calls over a list of N, for fp32 and bf16 pools, with the pipelined kernel
forced (bf16 spec calls of these sizes otherwise run the spec stream kernel, which has no TMA loads), the
two policies alternating in --rounds rounds, each a CUDA graph of bench_decode's calls timed by events
(median of --iters replays).  It prints, per (dtype, N), each policy's median over rounds and the change;
the auto rule of decode_load_evict_first (src/cuda_runtime_glue.cu) is read off this table.

    python3 bench/probe_decode_load_policy.py --Ns 16,32,64,128,256 --rounds 3 --json out.json
"""
import argparse
import json
import os
import statistics
import sys

os.environ["FLASHKDA_DECODE_KERNEL"] = "pipelined"  # before flashkda is loaded: what the sweep measures

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import bench_prefill as bp  # noqa: E402
from flashkda.timing import cuda_graph_times_us  # noqa: E402

POLICIES = ("normal", "evict_first")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--Ns", default="16,32,48,64,96,128,160,192,256", help="comma-separated request counts")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--H", type=int, default=bd.H_DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    T = 1 + bd.NUM_SPEC
    copy_bw = bp.copy_bandwidth()  # bytes / s, read + write, measured here
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; spec 1+{bd.NUM_SPEC}, H = {args.H}, pipelined kernel forced")
    rows = []
    for dt in args.dtypes.split(","):
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        for N in (int(n) for n in args.Ns.split(",")):
            x = bd.make_case(N, T, True, dtype, args.H, seed=N)
            fn = bd.Ours(x)
            per = {p: [] for p in POLICIES}
            for r in range(args.rounds):
                order = POLICIES if r % 2 == 0 else POLICIES[::-1]  # alternate who goes first
                for p in order:
                    os.environ["FLASHKDA_DECODE_LOAD_POLICY"] = p  # read at capture (each call)
                    times = cuda_graph_times_us(fn, args.iters, calls_per_graph=bd.CALLS_PER_GRAPH)
                    per[p].append(statistics.median(times))
            torch.cuda.synchronize()
            floor_us = bd.decode_floor_bytes(N, T, args.H, bd.D, dtype.itemsize, True) / copy_bw * 1e6
            normal = statistics.median(per["normal"])
            ef = statistics.median(per["evict_first"])
            r = dict(dtype=dt, N=N, normal_us=normal, evict_first_us=ef, change_pct=100 * (ef / normal - 1),
                     normal_rounds=per["normal"], evict_first_rounds=per["evict_first"], floor_us=floor_us,
                     # what decode_load_evict_first's rule compares: the state read once a call
                     state_read_bytes=N * args.H * bd.D * bd.D * dtype.itemsize)
            rows.append(r)
            rs = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(per["normal"], per["evict_first"]))
            print(f"{dt} N={N:4d}  normal {normal:8.1f} us  evict_first {ef:8.1f} us  {r['change_pct']:+6.2f}%"
                  f"  ({100 * floor_us / normal:5.1f}% -> {100 * floor_us / ef:5.1f}% of copy BW)  rounds {rs}",
                  flush=True)
            del x, fn
            torch.cuda.empty_cache()
    os.environ.pop("FLASHKDA_DECODE_LOAD_POLICY", None)
    meta = bp.run_meta()
    meta.update(H=args.H, T=T, rounds=args.rounds, iters=args.iters, copy_bandwidth_TBps=copy_bw / 1e12,
                kernel="pipelined")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
