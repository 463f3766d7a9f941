#!/usr/bin/env python3
"""Compiles the sm90 kernel translation units with ptxas -v and checks what the build does not:

- no wgmma serialisation and no fences injected into a wgmma batch (ptxas prints C7520 "wgmma.mma_async
  instructions are serialized" and C7519 "warpgroup.arrive is injected" as *info* lines, which -Werror
  and -warn-spills do not catch; a serialised wgmma waits for each instruction to finish, see
  docs/perf-notes.md v9; an injected arrive splits a batch, as a branch inside one did on a branch
  of 2026-12-04);
- no spills in the prefill hot kernels (chunk_prepare, state_recurrence, segment_scan), whose
  registers hold wgmma / mma accumulators.

Prints each kernel's registers and spills.  Run by ctest when the CUDA kernels are built:
    python3 scripts/check_ptxas.py --nvcc /usr/local/cuda/bin/nvcc
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

UNITS = [
    "csrc/sm90/kda_prefill_sm90_d128.cu",
    "csrc/sm90/kda_prefill_sm90_d64.cu",
    "csrc/sm90/kda_decode_sm90_d128_f32.cu",
    "csrc/sm90/kda_decode_sm90_d128_bf16.cu",
    "csrc/sm90/kda_decode_sm90_d64_f32.cu",
    "csrc/sm90/kda_decode_sm90_d64_bf16.cu",
]
NO_SPILL = ("chunk_prepare_kernel", "state_recurrence_kernel", "segment_scan_kernel")


def parse(log):
    """(kernel, registers, spill store bytes) per function, and the serialisation messages."""
    kernels, serialised, name = [], [], None
    spills = 0
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spills = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            kernels.append((name, int(m.group(1)), spills))
            name, spills = None, 0
        if ("C7520" in line or "wgmma.mma_async instructions are serialized" in line or "C7519" in line
                or "warpgroup.arrive is injected" in line):
            serialised.append(line.strip())
    return kernels, serialised


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for unit in UNITS:
            cmd = [args.nvcc, "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "-lineinfo",
                   "--expt-relaxed-constexpr", "-Xptxas=-v", "-I", os.path.join(args.root, "include"),
                   "-I", os.path.join(args.root, "csrc"), "-cubin", "-o", os.path.join(tmp, "k.cubin"),
                   os.path.join(args.root, unit)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout + r.stderr)
                failures.append(f"{unit}: nvcc failed ({r.returncode})")
                continue
            kernels, serialised = parse(r.stdout + r.stderr)
            if not kernels:
                failures.append(f"{unit}: no ptxas function report (is -Xptxas=-v honoured?)")
            print(f"== {unit}")
            for name, regs, spill in kernels:
                short = re.sub(r"^_ZN8flashkda4sm90\d+", "", name)[:60]
                print(f"  {regs:4d} registers  {spill:4d} B spilled  {short}")
                if spill > 0 and any(k in name for k in NO_SPILL):
                    failures.append(f"{unit}: {name} spills {spill} bytes")
            failures += [f"{unit}: {s}" for s in serialised]
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("ok: no wgmma serialisation or injected fences, no spills in the prefill hot kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
