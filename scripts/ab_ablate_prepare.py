#!/usr/bin/env python3
"""Writes ablation overlays of chunk_prepare for scripts/ab_bench.sh: each one removes one phase (or
one cost) of the kernel, so that an A/B in one device call measures what that phase costs.  The
results of an ablated kernel are wrong; only its time means anything.  perf-notes v11 has the first
table (8x2048 H16: W / UT 72 us, L / MQK 70 us, QT / KD 31 us, ...).

    python3 scripts/ab_ablate_prepare.py                 # every ablation -> ab/x_<name>/...
    python3 scripts/ab_ablate_prepare.py p3 tinv --out ab  # some of them
    VARIANTS="x_p3 x_tinv" CASES=0 ROUNDS=2 bash scripts/ab_bench.sh   # then, on the device

Each ablation is a list of exact source edits; when the kernel changes so that one no longer
applies, this script names it and writes nothing (update the edit, do not guess).
"""
import argparse
import os
import sys

KERNEL = "csrc/sm90/kda_chunk_prepare.cuh"

# name -> (what it removes, [(exact text, replacement)])
ABLATIONS = {
    "p2": ("phase 2: QT / KD / KT (their exponentials and record stores)",
           [("""    if (qk16) {
      qt_kd_passes(std::true_type{});
    } else {
      qt_kd_passes(std::false_type{});
    }""", "    (void)qt_kd_passes;")]),
    "p3": ("phase 3: the L / MQK blocks and the diagonal T_inv substitution",
           [("""    if (qk16) {
      blocks(std::true_type{});
    } else {
      blocks(std::false_type{});
    }""", "    (void)blocks;")]),
    "tinv": ("the T_inv column walks (off-diagonal blocks of T_inv)",
             [("  if (warp < 3) {  // column J = warp", "  if (warp < 0) {  // column J = warp")]),
    "gate": ("the bounded gate's two SFU operations per element (the FFMA stays)",
             [("xg[i] = lb2 * fast_rcp(1.f + fast_exp2(fmaf(xg[i], c1, gb[i])));",
               "xg[i] = fmaf(xg[i], c1, gb[i]);")]),
    "dram": ("DRAM traffic of the records: every block writes into one of 8 slots a head (L2-resident)",
             [("char* rec = a.records + (static_cast<int64_t>(slot) * a.H + h) * ChunkRecord<D>::kBytes;",
               "char* rec = a.records + (static_cast<int64_t>(slot & 7) * a.H + h) * ChunkRecord<D>::kBytes;")]),
}


def ablate(source, name):
    """The kernel source with ablation `name` applied; ValueError when an edit does not apply once."""
    _, edits = ABLATIONS[name]
    for old, new in edits:
        n = source.count(old)
        if n != 1:
            raise ValueError(f"ablation {name!r}: its edit matches {n} places in {KERNEL} (expected 1): "
                             f"{old.strip().splitlines()[0]!r}")
        source = source.replace(old, new)
    return source


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"ablations (default: all): {', '.join(ABLATIONS)}")
    ap.add_argument("--root", default=".", help="repository root")
    ap.add_argument("--out", default="ab", help="overlay folder (relative to --root)")
    args = ap.parse_args(argv)
    names = args.names or list(ABLATIONS)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        ap.error(f"unknown ablation(s) {unknown}; known: {list(ABLATIONS)}")
    with open(os.path.join(args.root, KERNEL)) as f:
        source = f.read()
    try:
        variants = {n: ablate(source, n) for n in names}  # all or nothing
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    for n, text in variants.items():
        path = os.path.join(args.root, args.out, f"x_{n}", KERNEL)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"{os.path.join(args.out, 'x_' + n)}: {ABLATIONS[n][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
