"""Context parallelism's segment length, swept (issue 4: few sequences x heads).

The automatic plan (auto_segment_chunks, src/api.cpp) picks nseg - 1 = (SMs - 1) / b segments of equal
length (b = N H D / 64 blocks a segment walk), so that the head walk and the maps of segments 1 .. nseg - 2
fill one wave and the segment walks another.  This times the fwd op with the segment length forced
(FLASHKDA_PREFILL_SEGMENT_CHUNKS, read when the call is captured) around the automatic choice, interleaved
over rounds, each forced length against "auto" on the same inputs, and checks that every plan gives the
automatic plan's output and final state up to rounding (the segment maps change the summation order).
Usage: python3 bench/probe_cp_segments.py [--json out.json] [--rounds 3] [--iters 30]
"""
import argparse
import json
import os
import statistics

import torch

from bench_prefill import CASES, Ours, make_inputs, run_meta, time_graph
from bench_state_dtype import interleaved
from flashkda.reference import rel_err

# (case index, forced segment lengths in chunks); auto is 52 chunks (1x16384) and 205 (1x65536) on 132 SMs.
SWEEPS = ((2, (32, 43, 64, 86)), (8, (128, 171, 256, 342)))
ENV = "FLASHKDA_PREFILL_SEGMENT_CHUNKS"


def with_segments(value, fn):
    """fn() with the segment length forced to value (None: the automatic plan)."""
    if value is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = str(value)
    try:
        return fn()
    finally:
        os.environ.pop(ENV, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    rows = []
    for case, lengths in SWEEPS:
        name, lens, H = CASES[case]
        x = make_inputs(lens, H)
        plans = [None] + list(lengths)
        runs = {p: with_segments(p, lambda: Ours(x, H)) for p in plans}  # workspace sized for the plan
        for p, fn in runs.items():
            with_segments(p, fn)
        torch.cuda.synchronize()
        # the plan is read when the graph is captured, so each timing captures under its own setting
        timers = {p: (lambda p=p: with_segments(p, lambda: time_graph(runs[p], args.iters)[0])) for p in plans}
        times = interleaved(timers, args.rounds, lambda timer: timer())
        auto = statistics.median(times[None])
        for p in plans:
            out_rel = rel_err(runs[p].out, runs[None].out)
            ht_rel = rel_err(runs[p].ht, runs[None].ht)
            med = statistics.median(times[p])
            rows.append({"case": name, "segment_chunks": p or "auto", "us": times[p], "median_us": med,
                         "over_auto": med / auto, "out_rel_vs_auto": out_rel, "state_rel_vs_auto": ht_rel})
            print(f"{name:14s} segments of {str(p or 'auto'):>4s} chunks  {med:8.1f} us  /auto {med / auto:.4f}"
                  f"  (out rel {out_rel:.2e}, state rel {ht_rel:.2e} against auto)", flush=True)
        del runs, x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "cp_segments": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
