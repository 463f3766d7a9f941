"""fp32 vs bf16 state in/out on the same prefill (issue 4: bf16 must be no slower), interleaved, and
the fp32 state-pool addressing against contiguous states (issue 6: no more costly).

One median of CUDA-graph replays moves by ~0.5% between runs, the size of the difference in question,
so the two dtypes are timed in alternation, ROUNDS times each, through the same op (flashkda.prefill)
on the same inputs and one shared output / workspace, and the median over rounds of each, the
per-round bf16 / fp32 ratios and their median are reported.  A third variant, fp32 tensors holding the
bf16-rounded values, separates a dtype cost from a data-dependent one; per-kernel times come from the
profiler (3 interleaved rounds).  --entry-exit also times state_recurrence with only the initial or
only the final state of each dtype.
Usage: python3 bench/bench_state_dtype.py [--json out.json] [--rounds 7] [--entry-exit].
"""

import argparse
import json
import statistics

import torch

from bench_prefill import CASES, OursVariant, kernel_times, make_inputs, run_meta, time_graph

CASE_IDS = (0, 3)  # 8x2048 H16, 1x8192 H64


def interleaved(fns, rounds, measure):
    """measure(fn) for every fn of the dict, `rounds` times, the order reversed every other round
    (so that neither side always runs first); returns {key: [result per round]}."""
    out = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(list(fns)))):
            out[k].append(measure(fns[k]))
    return out


def interleaved_kernel_times(fns, iters, rounds=3):
    """Per-kernel profiler times of each fn, median over interleaved rounds."""
    kt = interleaved(fns, rounds, lambda fn: kernel_times(fn, iters))
    return {k: {n: statistics.median(d[n] for d in kt[k]) for n in kt[k][0]} for k in fns}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--entry-exit", action="store_true",
                    help="also time state_recurrence with the initial state only / the final state only, per dtype")
    ap.add_argument("--pool-probe", action="store_true",
                    help="also time a pool of N rows in order (pool_identity), contiguous states in place and the "
                         "pool with has_initial_state (pool_hist)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    rows = []
    for i in CASE_IDS:
        name, lens, H = CASES[i]
        x = make_inputs(lens, H)
        # One output and one workspace (the fp32 variant's) for all: the A/B differs in the state
        # tensors only.  fp32_bf16vals: fp32 tensors holding the bf16-rounded values (separates a dtype
        # cost from a data-dependent one).
        base = OursVariant(x, H, "fp32_state_prefill_op")
        out, ws = base.out, base.ws
        fns = {"fp32": base, "bf16": OursVariant(x, H, "bf16_state", out, ws),
               "fp32_bf16vals": OursVariant(x, H, "fp32_state_bf16_values", out, ws),
               "pool": OursVariant(x, H, "pool", out, ws)}
        if args.pool_probe:  # where a pool's cost comes from: the index path or the pool rows' placement
            fns.update(pool_identity=OursVariant(x, H, "pool_identity", out, ws),
                       fp32_inplace=OursVariant(x, H, "fp32_inplace", out, ws),
                       pool_hist=OursVariant(x, H, "pool_hist", out, ws))
        times = interleaved(fns, args.rounds, lambda fn: time_graph(fn, args.iters)[0])
        ratios = [b / f for f, b in zip(times["fp32"], times["bf16"])]
        row = {"case": name, "fp32_us": times["fp32"], "bf16_us": times["bf16"],
               "fp32_median_us": statistics.median(times["fp32"]), "bf16_median_us": statistics.median(times["bf16"]),
               "bf16_over_fp32_median": statistics.median(ratios), "rounds_bf16_faster": sum(q < 1 for q in ratios)}
        # issue 6: prefill with pool addressing (fp32 pool of 4N rows, in place) costs no more than contiguous
        pratios = [p / f for f, p in zip(times["fp32"], times["pool"])]
        row.update(pool_us=times["pool"], pool_median_us=statistics.median(times["pool"]),
                   pool_over_fp32_median=statistics.median(pratios), rounds_pool_faster=sum(q < 1 for q in pratios))
        row["fp32_bf16vals_us"] = times["fp32_bf16vals"]
        row["fp32_bf16vals_median_us"] = statistics.median(times["fp32_bf16vals"])
        row["kernel_us"] = interleaved_kernel_times(fns, args.iters)
        if args.entry_exit:  # which end of the state pass carries a dtype cost: h0 only, ht only
            ee = {}
            for dt in ("fp32", "bf16"):
                h0 = x["h0"] if dt == "fp32" else x["h0"].bfloat16()
                for end in ("h0_only", "ht_only"):
                    v = OursVariant(x, H, "fp32_state_prefill_op", out, ws)
                    v.kw = dict(initial_state=h0) if end == "h0_only" else dict(final_state=torch.empty_like(h0))
                    ee[f"{end}_{dt}"] = v
            row["entry_exit_us"] = interleaved_kernel_times(ee, args.iters)
            for k in ee:
                rec = [v for n, v in row["entry_exit_us"][k].items() if "state_recurrence" in n]
                print(f"    {k:12s} state_recurrence {rec[0] if rec else float('nan'):8.1f} us", flush=True)
        rows.append(row)
        print(f"{name:14s} fp32 {row['fp32_median_us']:8.1f} us  bf16 {row['bf16_median_us']:8.1f} us  "
              f"bf16/fp32 median {row['bf16_over_fp32_median']:.4f}  bf16 faster in {row['rounds_bf16_faster']}"
              f"/{args.rounds} rounds  (fp32 {min(times['fp32']):.1f}-{max(times['fp32']):.1f}, "
              f"bf16 {min(times['bf16']):.1f}-{max(times['bf16']):.1f})", flush=True)
        print(f"    fp32 holding bf16 values: {row['fp32_bf16vals_median_us']:8.1f} us", flush=True)
        for k in ("pool_identity", "fp32_inplace", "pool_hist"):
            if k in times:
                row[k + "_us"] = times[k]
                row[k + "_over_fp32_median"] = statistics.median(p / f for f, p in zip(times["fp32"], times[k]))
                print(f"    {k}: {statistics.median(times[k]):8.1f} us  /fp32 median {row[k + '_over_fp32_median']:.4f}",
                      flush=True)
        print(f"    pool (fp32, in place): {row['pool_median_us']:8.1f} us  pool/fp32 median "
              f"{row['pool_over_fp32_median']:.4f}  pool faster in {row['rounds_pool_faster']}/{args.rounds} rounds",
              flush=True)
        for kname in row["kernel_us"]["fp32"]:
            print(f"    {kname:60s} " + "  ".join(f"{k} {row['kernel_us'][k].get(kname, float('nan')):8.1f}" for k in fns)
                  + " us", flush=True)
        del fns, x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "state_dtype": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
