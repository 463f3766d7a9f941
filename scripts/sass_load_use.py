#!/usr/bin/env python3
"""Global loads of one kernel's SASS with the distance to their first use: a load whose consumer
follows within a few instructions makes the warp wait there for a full memory round trip, which
costs time when that point is on a chain (a block's prologue at one block an SM, the walk's chunk
loop).  The compiler puts a widening (int32 index -> 64 bits) or a conversion (bf16 -> fp32) right
after a load, so a load written early in the source can still stall early: perf-notes v27 found the
pool-row, has_initial_state, checkpoint-offset and checkpoint_advance stalls this way, without a GPU.

    python3 scripts/sass_load_use.py k.sass state_recurrence_kernelILi128ELi8 [--max 8]
    python3 scripts/sass_load_use.py build/k.cubin chunk_prepare_kernelILi128   # cuobjdump -sass

Input: `cuobjdump -sass` text, or a cubin (disassembled with CUOBJDUMP or cuobjdump from PATH).  Lists
each LDG / LD (not LDGSTS, whose data goes to shared memory) with its line in the kernel's listing and
the number of instructions until one reads a destination register; --max keeps the loads used within
N instructions.  Static: a cold path's loads are listed like a hot one's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_blocks import function_lines, text_or_tool_output  # noqa: E402 (scripts/ is this script's own folder)

_FUNC = re.compile(r"^\s*Function : (\S+)")
_LOAD = re.compile(r"^(?:@!?U?P[T\d]+\s+)?(LDG\.E[\w.]*|LD\.E[\w.]*)\s+(R\d+)\s*,")
_OPCODE = re.compile(r"^(?:@!?U?P[T\d]+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)\s*(.*?)\s*;")


def sass_text(path):
    """`cuobjdump -sass` text of a cubin, or the file itself when it is already text."""
    return text_or_tool_output(path, "cuobjdump", "CUOBJDUMP", ["-sass"])


def kernel_lines(text, name):
    """The instruction lines (comments and addresses stripped) of the first function containing name."""
    out = []
    for line in function_lines(text, name, _FUNC) or []:
        body = re.sub(r"/\*[^*]*\*/", "", line).strip()
        if body and not body.startswith("."):
            out.append(body)
    return out


def registers(load_op, first):
    """Destination registers of a load: one, two (.64) or four (.128) consecutive ones."""
    n = int(first[1:])
    width = 4 if ".128" in load_op else 2 if ".64" in load_op else 1
    return {f"R{n + k}" for k in range(width)}


def load_uses(lines, horizon=400):
    """(index, opcode, first register, distance to the first reader or None) for every load."""
    found = []
    for i, line in enumerate(lines):
        m = _LOAD.match(line)
        if not m:
            continue
        regs = registers(m.group(1), m.group(2))
        dist = None
        for j in range(i + 1, min(len(lines), i + 1 + horizon)):
            op = _OPCODE.match(lines[j])
            if not op:
                continue
            operands = [x for x in re.split(r"[\s,\[\]]+", op.group(2)) if x]
            # stores read every operand; everything else writes its first operand
            sources = operands if op.group(1).startswith("ST") else operands[1:]
            if any(x.split(".")[0] in regs for x in sources):
                dist = j - i
                break
        found.append((i, m.group(1), m.group(2), dist))
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="cuobjdump -sass text or a cubin")
    ap.add_argument("kernel", help="a substring of the mangled kernel name")
    ap.add_argument("--max", type=int, default=None, help="only loads first used within N instructions")
    args = ap.parse_args(argv)
    lines = kernel_lines(sass_text(args.sass), args.kernel)
    if not lines:
        sys.exit(f"no function containing {args.kernel!r}")
    for i, op, reg, dist in load_uses(lines):
        if args.max is not None and (dist is None or dist > args.max):
            continue
        use = f"+{dist}" if dist is not None else "none found"
        print(f"{i + 1:6d}  {op:18s} {reg:5s} first use {use:>6s}  {lines[i + dist] if dist else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
