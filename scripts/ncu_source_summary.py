"""Summarises an Nsight Compute per-instruction source page (csv, from
`ncu -i REPORT --page source --csv --print-source sass`; scripts/profile_decode_source.sh writes one
per case, scripts/profile_prefill_source.sh one per kernel): total stall samples by reason, then the
instructions with the most samples, then samples grouped by execution count (instructions executed
equally often belong to the same loop of the same warp role, so this splits the time between roles
without source line information).  --phases also splits the kernel at its barriers and exits (BAR,
EXIT, RET in program order): for a kernel whose phases are separated by __syncthreads, such as
chunk_prepare, that is the time per phase, with its instruction count, main stall reasons and
opcodes.  (ncu's per-CUDA-line page carries no metrics in csv form, hence this.)

    python3 scripts/ncu_source_summary.py CASE_sass.csv [--top 25] [--phases]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--phases", action="store_true", help="samples per barrier-delimited segment")
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
    if args.phases:
        print("\nsegments ending at a barrier or exit (first-last index, share, instructions executed, "
              "main stall reasons, most executed opcodes):")
        start = 0
        def opcode(r):  # "@!P0 BAR.SYNC ..." -> "BAR.SYNC"
            words = [w for w in r[ix["Source"]].split() if not w.startswith("@")]
            return words[0] if words else ""

        for i, r in enumerate(data):
            if i + 1 < len(data) and not opcode(r).startswith(("BAR", "EXIT", "RET")):
                continue
            seg = data[start:i + 1]
            share = sum(num(x, col_s) for x in seg) / total
            if share >= 0.005:
                stalls = collections.Counter({k[6:]: sum(num(x, ix[k]) for x in seg) for k in reasons})
                ops = collections.Counter()
                for x in seg:
                    ops[opcode(x).split(".")[0]] += num(x, col_e)
                print(f"  {start:5d}-{i:5d} {share:6.1%} {int(sum(num(x, col_e) for x in seg)):11d}  "
                      + ", ".join(f"{k} {int(v)}" for k, v in stalls.most_common(3)) + " | "
                      + ", ".join(f"{k} {int(v)}" for k, v in ops.most_common(5)))
            start = i + 1


if __name__ == "__main__":
    main()
