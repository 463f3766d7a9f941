"""Summarises an Nsight Compute per-instruction source page (csv, from
`ncu -i REPORT --page source --csv --print-source sass`; scripts/profile_decode_source.sh writes one
per case, scripts/profile_prefill_source.sh one per kernel): total stall samples by reason, then the
instructions with the most samples, then samples grouped by execution count (instructions executed
equally often belong to the same loop of the same warp role, so this splits the time between roles
without source line information).  --phases also splits the kernel at its barriers and exits (BAR,
EXIT, RET in program order): for a kernel whose phases are separated by __syncthreads, such as
chunk_prepare, that is the time per phase, with its instruction count, main stall reasons and
opcodes.  (ncu's per-CUDA-line page carries no metrics in csv form, hence this.)  --pipes CYCLES
(the report's "Elapsed Cycles") adds, per segment, what its instructions ask of each pipe at that
pipe's peak rate, as a share of the SM cycles the segment took (its share of the stall samples times
CYCLES): a value near or above 100% says the segment runs that pipe flat out while it runs.  The
sample share counts warp time (warps waiting at a barrier count in the segment after it), so it is an
estimate; it answers "does a phase saturate one unit while the others idle?" (perf-notes v10).

    python3 scripts/ncu_source_summary.py CASE_sass.csv [--top 25] [--phases] [--pipes CYCLES --sms 132]
"""
import argparse
import collections
import csv

# Warp instructions a pipe issues per SM and cycle on sm_90 (4 sub-partitions: FP32 FMA 1 each,
# integer / logic ALU 1/2, MUFU (XU) 16 lanes an SM, HMMA m16n8k16 one per 2 cycles each); the LSU
# is counted in L1 wavefronts (shared) plus global sectors / 4, one per SM and cycle.
PIPE_RATE = {"fma": 4.0, "alu": 2.0, "xu": 0.5, "tensor": 2.0, "lsu": 1.0}
_FMA = {"FFMA", "FMUL", "FADD", "IMAD", "FMNMX", "HFMA2", "HMUL2", "HADD2", "FSETP", "FSEL", "HMNMX2"}
_LSU = {"LDS", "STS", "LDSM", "LDG", "STG", "LDGSTS", "ATOMS", "LDL", "STL", "ATOMG", "RED", "ATOM"}
_NON_ISSUE = {"BAR", "EXIT", "RET", "BRA", "BSSY", "BSYNC", "WARPSYNC", "NOP", "DEPBAR", "LDGDEPBAR"}


def pipe_of(opcode):
    """The pipe class of a SASS opcode ("FFMA.FTZ" -> "fma"); None for control flow and waits."""
    op = opcode.split(".")[0]
    if op in _NON_ISSUE:
        return None
    if op == "MUFU":
        return "xu"
    if op == "HMMA":
        return "tensor"
    if op in _FMA:
        return "fma"
    if op in _LSU:
        return "lsu"
    return "alu"


def pipe_demand(seg_counts, wavefronts, share, cycles, sms):
    """Per pipe, the SM cycles a segment's instructions need at the pipe's peak over the SM cycles
    the segment took (share x cycles): {pipe: fraction}.  seg_counts: {pipe: warp instructions}
    summed over the kernel; wavefronts: the segment's LSU wavefronts."""
    spent = share * cycles
    if spent <= 0:
        return {k: 0.0 for k in PIPE_RATE}
    need = {k: seg_counts.get(k, 0.0) / sms / PIPE_RATE[k] for k in ("fma", "alu", "xu", "tensor")}
    need["lsu"] = wavefronts / sms / PIPE_RATE["lsu"]
    return {k: need[k] / spent for k in PIPE_RATE}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--phases", action="store_true", help="samples per barrier-delimited segment")
    ap.add_argument("--pipes", type=float, default=0.0, metavar="CYCLES",
                    help="with --phases: per-segment pipe demand, given the kernel's elapsed cycles")
    ap.add_argument("--sms", type=int, default=132)
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
                if args.pipes > 0:
                    counts = collections.Counter()
                    for x in seg:
                        p = pipe_of(opcode(x))
                        if p:
                            counts[p] += num(x, col_e)
                    wf = sum(num(x, ix["L1 Wavefronts Shared"]) + num(x, ix["L2 Theoretical Sectors Global"]) / 4
                             for x in seg) if "L1 Wavefronts Shared" in ix else 0.0
                    d = pipe_demand(counts, wf, share, args.pipes, args.sms)
                    print("               pipe demand / time: " + ", ".join(f"{k} {v:.0%}" for k, v in d.items()))
            start = i + 1


if __name__ == "__main__":
    main()
