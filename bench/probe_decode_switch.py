"""Probe: one decode dev switch's values against each other over N (spec 1+3, pipelined kernel forced).

The pipelined decode kernel (fp32 spec calls) has host-side dev switches that are read at every call, so one
process can time each value of one of them in alternating rounds:
- FLASHKDA_DECODE_LOAD_POLICY=normal | evict_first: the L2 policy of the state-slice loads (perf-notes v39, v40;
  the auto rule of decode_load_evict_first in src/cuda_runtime_glue.cu is read off this sweep, the default);
- FLASHKDA_DECODE_PREFETCH=<0..32> (experiments/decode-read-burst.patch): how many of each block's first items'
  state slices the producer reads into L2 at the block's start.
For each (pool dtype, N) the probe times spec 1+3 calls at H = 16 with every value of the switch, the order of
the values reversed every other round (--rounds), each a CUDA graph of bench_decode's calls timed by events
(median of --iters replays), and prints each value's median over rounds and its change against the first value.
bf16 spec calls of these sizes otherwise run the spec stream kernel, which has no TMA loads: the pipelined
kernel is forced (FLASHKDA_DECODE_KERNEL=pipelined) for both dtypes.

    python3 bench/probe_decode_switch.py --Ns 16,32,64,128,256 --rounds 3 --json out.json
    python3 bench/probe_decode_switch.py --switch FLASHKDA_DECODE_PREFETCH=0,4,8,12,16 --dtypes fp32 --json pf.json
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

DEFAULT_SWITCH = "FLASHKDA_DECODE_LOAD_POLICY=normal,evict_first"


def parse_switch(text):
    """'VAR=a,b,c' -> ('VAR', ['a', 'b', 'c']), at least two values (the first is the reference)."""
    var, sep, values = text.partition("=")
    vals = [v for v in values.split(",") if v]
    if not sep or not var.startswith("FLASHKDA_") or len(vals) < 2:
        raise SystemExit(f"--switch: expected FLASHKDA_<NAME>=<value>,<value>[,...] (two values at least), "
                         f"got {text!r}")
    return var, vals


def round_orders(values, rounds):
    """The values' order in each round: as given in even rounds, reversed in odd ones, so no value is
    always timed first (the pool's lines left in L2 by the previous graph favour whoever follows)."""
    return [list(values) if r % 2 == 0 else list(values)[::-1] for r in range(rounds)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", default=DEFAULT_SWITCH, help=f"VAR=v1,v2,... (default {DEFAULT_SWITCH})")
    ap.add_argument("--Ns", default="16,32,48,64,96,128,160,192,256", help="comma-separated request counts")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--H", type=int, default=bd.H_DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    var, values = parse_switch(args.switch)

    T = 1 + bd.NUM_SPEC
    copy_bw = bp.copy_bandwidth()  # bytes / s, read + write, measured here
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; spec 1+{bd.NUM_SPEC}, H = {args.H}, pipelined kernel forced; "
          f"{var} in {values}")
    rows = []
    for dt in args.dtypes.split(","):
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        for N in (int(n) for n in args.Ns.split(",")):
            x = bd.make_case(N, T, True, dtype, args.H, seed=N)
            fn = bd.Ours(x)
            per = {v: [] for v in values}
            for order in round_orders(values, args.rounds):
                for v in order:
                    os.environ[var] = v  # read by the host at each call, i.e. at the graph's capture
                    times = cuda_graph_times_us(fn, args.iters, calls_per_graph=bd.CALLS_PER_GRAPH)
                    per[v].append(statistics.median(times))
            torch.cuda.synchronize()
            floor_us = bd.decode_floor_bytes(N, T, args.H, bd.D, dtype.itemsize, True) / copy_bw * 1e6
            med = {v: statistics.median(per[v]) for v in values}
            ref = med[values[0]]
            r = dict(dtype=dt, N=N, floor_us=floor_us,
                     # what decode_load_evict_first's rule compares: the state read once a call
                     state_read_bytes=N * args.H * bd.D * bd.D * dtype.itemsize,
                     values={v: dict(median_us=med[v], change_pct=100 * (med[v] / ref - 1), rounds_us=per[v],
                                     copy_bw_pct=100 * floor_us / med[v]) for v in values})
            rows.append(r)
            cells = "  ".join(f"{v} {med[v]:8.1f} us ({100 * (med[v] / ref - 1):+6.2f}%, "
                              f"{100 * floor_us / med[v]:5.1f}% BW)" for v in values)
            print(f"{dt} N={N:4d}  {cells}", flush=True)
            del x, fn
            torch.cuda.empty_cache()
    os.environ.pop(var, None)
    meta = bp.run_meta()
    meta.update(H=args.H, T=T, rounds=args.rounds, iters=args.iters, copy_bandwidth_TBps=copy_bw / 1e12,
                kernel="pipelined", switch=var, switch_values=values)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
