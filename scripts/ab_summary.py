"""Summarise scripts/ab_bench.sh runs: per case and variant, the median over rounds of the call time
and of each kernel's time, and each variant against "base" (negative = faster than base).

    python3 scripts/ab_summary.py out/ab_*_r*.json
    python3 scripts/ab_summary.py --ratio chunk_prepare out/ab_*_r*.json

--ratio PATTERN adds a second table: per case and variant, the median over rounds of the summed time
of the kernels whose name matches PATTERN (a regular expression), and its ratio to base's.  Kernels
renamed by a variant still compare (chunk_prepare_kernel against chunk_prepare_persistent_kernel): the
ratio is the "x" of docs/design.md's "The fused kernel, measured first".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys


def load(paths):
    """{case: {variant: [row, ...]}} from files named ab_<variant>_r<round>.json."""
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for p in paths:
        m = re.match(r"ab_(.+)_r(\d+)\.json$", os.path.basename(p))
        if not m:
            raise SystemExit(f"{p}: expected a name ab_<variant>_r<round>.json")
        with open(p) as f:
            d = json.load(f)
            for row in d.get("prefill", []) + d.get("decode", []):
                runs[row["case"]][m.group(1)].append(row)
                # bench_prefill times few-sequence cases once more without context parallelism: a
                # whole 4-warp walk on a few SMs, latency-bound where the full-GPU walks run at the
                # GPU's DRAM rate (an H100's, perf-notes v19), so it shows walk changes they hide.
                if row.get("ours_no_cp_us"):
                    runs[row["case"] + ", no CP"][m.group(1)].append(
                        {"case": row["case"] + ", no CP", "ours_us": row["ours_no_cp_us"],
                         "ours_kernels_us": row.get("ours_no_cp_kernels_us") or {}})
            # bench_prefill's serving variants (ab_bench.sh PREFILL_VARIANTS=1): one row per variant
            # of the same call (pool addressing, bf16 state, checkpoints), with its per-kernel times
            # where the JSON has them (<variant>_kernels_us).
            for row in d.get("prefill_variants", []):
                for key, t in row.items():
                    if key.endswith("_us") and not key.endswith("_kernels_us") and t:
                        name = f"{row['case']}, {key[:-3]}"
                        runs[name][m.group(1)].append(
                            {"case": name, "ours_us": t, "ours_kernels_us": row.get(key[:-3] + "_kernels_us") or {}})
    return runs


def kernel_times(row):
    """A row's per-kernel times: those of the graph replays where the JSON has them (eager before)."""
    return row.get("ours_kernels_graph_us") or row.get("ours_kernels_us") or {}


def summarise(runs, base_name="base"):
    """The table; `base_name` is the variant the others are compared with (listed first)."""
    lines = ["| case | variant | rounds | call (us) | vs base | per kernel (us) |", "|---|---|---|---|---|---|"]
    for case, by_var in runs.items():
        base = statistics.median(r["ours_us"] for r in by_var[base_name]) if base_name in by_var else None
        for var in sorted(by_var, key=lambda v: (v != base_name, v)):
            rows = by_var[var]
            call = statistics.median(r["ours_us"] for r in rows)
            kernels = collections.defaultdict(list)
            for r in rows:
                for k, t in kernel_times(r).items():
                    kernels[k].append(t)
            per_kernel = ", ".join(f"{k.replace('void flashkda::sm90::', '').strip()} {statistics.median(v):.1f}"
                                   for k, v in kernels.items())
            bw = [r["pct_copy_bw"] for r in rows if r.get("pct_copy_bw") is not None]  # bench_decode's rows
            if bw:
                share = f"{statistics.median(bw):.1f}% of copy BW"
                per_kernel = f"{per_kernel}; {share}" if per_kernel else share
            delta = f"{100.0 * (call / base - 1.0):+.2f}%" if base and var != base_name else "-"
            lines.append(f"| {case} | {var} | {len(rows)} | {call:.1f} | {delta} | {per_kernel} |")
    return "\n".join(lines)


def kernel_ratio(runs, pattern, base_name="base"):
    """Per case and variant: the median summed time of the kernels matching `pattern`, and its ratio to
    base's (variants or rounds without such a kernel are left out)."""
    rx = re.compile(pattern)
    lines = [f"| case | variant | rounds | {pattern} (us) | ratio to base |", "|---|---|---|---|---|"]
    for case, by_var in runs.items():
        med = {}
        for var, rows in by_var.items():
            sums = []
            for r in rows:
                hit = [t for k, t in kernel_times(r).items() if rx.search(k)]
                if hit:
                    sums.append(sum(hit))
            if sums:
                med[var] = (statistics.median(sums), len(sums))
        for var in sorted(med, key=lambda v: (v != base_name, v)):
            t, n = med[var]
            ratio = f"{t / med[base_name][0]:.3f}" if base_name in med and var != base_name else "-"
            lines.append(f"| {case} | {var} | {n} | {t:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--base", default="base", help="the variant the others are compared with")
    ap.add_argument("--ratio", metavar="PATTERN", help="also the summed time of the kernels matching PATTERN, "
                    "against base's")
    args = ap.parse_args(argv)
    runs = load(args.json)
    print(summarise(runs, args.base))
    if args.ratio:
        print()
        print(kernel_ratio(runs, args.ratio, args.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
