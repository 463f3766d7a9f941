"""Summarises an Nsight Compute per-CUDA-line source page (csv, from
`ncu -i REPORT --page source --csv --print-source cuda`; scripts/profile_prefill_source.sh writes one
per kernel): the source lines with the most stall samples, and the samples summed over line ranges
when the page spans several files (one block per file).

    python3 scripts/ncu_line_summary.py KERNEL_cuda.csv [--top 40]
"""
import argparse
import csv


def num(x):
    try:
        return float(x or 0)
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    key = "Warp Stall Sampling (All Samples)"
    lines, hdr, fname = [], None, "?"
    for r in rows:
        if key in r:
            hdr = {h: i for i, h in enumerate(r)}
            continue
        if hdr is None or not r:
            if r and len(r) == 1:
                fname = r[0]
            continue
        if len(r) < len(hdr):
            if len(r) == 1:
                fname = r[0]
            continue
        ln = r[hdr["#"]] if "#" in hdr else r[0]
        lines.append((fname, ln, num(r[hdr[key]]), num(r[hdr.get("Instructions Executed", 0)]),
                      r[hdr["Source"]] if "Source" in hdr else ""))
    total = sum(x[2] for x in lines) or 1.0
    print(f"{len(lines)} source lines, {total:.0f} samples; header: {list(hdr)[:12] if hdr else None}")
    for f, ln, s, e, src in sorted(lines, key=lambda x: -x[2])[:args.top]:
        print(f"{f[-28:]:28s} {ln:>5s} {s / total:6.1%} {int(e):10d}  {src.strip()[:90]}")


if __name__ == "__main__":
    main()
