"""Summarises an Nsight Compute per-instruction source page (csv, from
`ncu -i REPORT --page source --csv --print-source sass`; scripts/profile_decode_source.sh writes one
per case): total stall samples by reason, then the instructions with the most samples, then samples
grouped by execution count (instructions executed equally often belong to the same loop of the same
warp role, so this splits the time between roles without source line information).

    python3 scripts/ncu_source_summary.py CASE_sass.csv [--top 25]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], rows[head + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    col_s, col_e = ix["Warp Stall Sampling (All Samples)"], ix["Instructions Executed"]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, c):
        try:
            return float(r[c] or 0)
        except (ValueError, IndexError):
            return 0.0

    total = sum(num(r, col_s) for r in data) or 1.0
    print(f"{len(data)} instructions, {total:.0f} samples")
    by_reason = collections.Counter({k[6:]: sum(num(r, ix[k]) for r in data) for k in reasons})
    print("stall reasons:", ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(8)))
    print(f"\ntop {args.top} instructions (index, executions, share, SASS, main reasons):")
    order = sorted(range(len(data)), key=lambda i: -num(data[i], col_s))
    for i in order[:args.top]:
        r = data[i]
        top2 = sorted(((num(r, ix[k]), k[6:]) for k in reasons), reverse=True)[:2]
        print(f"{i:6d} {int(num(r, col_e)):9d} {num(r, col_s) / total:6.1%}  {r[ix['Source']][:60]:60s} "
              + ", ".join(f"{k} {int(v)}" for v, k in top2 if v))
    groups = collections.Counter()
    count = collections.Counter()
    for r in data:
        e = int(num(r, col_e))
        groups[e] += num(r, col_s)
        count[e] += 1
    print("\nsamples by execution count (executions: instructions, share):")
    for e, s in groups.most_common(12):
        print(f"  {e:10d}: {count[e]:5d} instructions, {s / total:6.1%}")


if __name__ == "__main__":
    main()
