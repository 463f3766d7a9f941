#!/usr/bin/env python3
"""Static instruction mix of one kernel's SASS, per basic block, with its loops marked: for sessions
without a GPU, where a change's instruction count (and where it falls) is the only prediction at hand.

    python3 scripts/sass_blocks.py build/k.cubin chunk_prepare_kernelILi128 [--ops HMMA] [--min 40]
    python3 scripts/sass_blocks.py k.dis chunk_prepare_kernelILi128          # nvdisasm -c output

A cubin is disassembled with nvdisasm (NVDISASM or PATH).  Blocks start at nvdisasm's labels
(.L_x_N); a branch back to the same or an earlier block closes a loop, whose head block is marked
with the loop's size (its blocks and their instructions: one iteration of the static body) and whose
other blocks name their head.  --ops keeps the blocks holding any of the
given opcodes (e.g. HMMA for chunk_prepare's L / MQK loops), --min the blocks of at least N instructions.
Counts are static: a loop's body counts once, a cold path as much as a hot one.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

_FUNC = re.compile(r"^//-+ \.text\.(\S+) -+")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)([^;]*);")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def text_or_tool_output(path, tool_name, env, args):
    """The file itself when it is text, else (a cubin: an ELF file) what `tool_name args path` prints; the
    tool is $env or tool_name on PATH.  Shared with scripts/sass_load_use.py."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"\x7fELF":
        with open(path) as f:
            return f.read()
    tool = os.environ.get(env) or shutil.which(tool_name)
    if not tool:
        raise SystemExit(f"{tool_name} not found (set {env})")
    return subprocess.run([tool, *args, path], check=True, capture_output=True, text=True).stdout


def disassemble(path):
    """nvdisasm -c text of a cubin, or the file itself when it is already text."""
    return text_or_tool_output(path, "nvdisasm", "NVDISASM", ["-c"])


def function_lines(text, name, header=_FUNC):
    """The lines of the first function whose name contains `name`, None when there is none; `header`
    matches a function's first line with its name in group 1 (nvdisasm's by default).  Shared with
    scripts/sass_load_use.py (cuobjdump's headers)."""
    out, inside = [], False
    for line in text.splitlines():
        m = header.match(line)
        if m:
            if inside:
                break
            inside = name in m.group(1)
            continue
        if inside:
            out.append(line)
    return out if inside else None


def blocks_of(text, kernel):
    """[(label, [(opcode, operands), ...])] of the first function whose name contains `kernel`."""
    lines = function_lines(text, kernel)
    if lines is None:
        raise SystemExit(f"no function containing {kernel!r}")
    out, cur, label = [], None, "entry"
    for line in lines:
        m = _LABEL.match(line)
        if m:
            if cur:
                out.append((label, cur))
            label, cur = m.group(1), []
            continue
        m = _INSN.match(line)
        if m:
            if cur is None:
                cur = []
            cur.append((m.group(2), m.group(3)))
    if cur:
        out.append((label, cur))
    return out


def first_cold(blocks):
    """Index of the first out-of-line block: the code after the last EXIT (the compiler's divergent-warp
    paths of shuffles and the like, which branch back into the body when done: not loops)."""
    last_exit = max((i for i, (_, ins) in enumerate(blocks) if any(op == "EXIT" for op, _ in ins)), default=None)
    return len(blocks) if last_exit is None else last_exit + 1


def loops(blocks):
    """[(head, tail)] block index ranges of the loops: the block `tail` branches back to `head` <= tail
    (branches from the out-of-line code after the last EXIT excluded)."""
    order = {lab: i for i, (lab, _) in enumerate(blocks)}
    found = set()
    for i, (_, ins) in enumerate(blocks[:first_cold(blocks)]):
        for op, operands in ins:  # any branch of the block, conditional ones included
            if op.startswith("BRA"):
                m = _TARGET.search(operands)
                if m and m.group(1) in order and order[m.group(1)] <= i:
                    found.add((order[m.group(1)], i))
    return sorted(found)


def report(blocks, ops=None, min_size=0, top=12):
    spans = loops(blocks)
    total = collections.Counter(op.split(".")[0] for _, ins in blocks for op, _ in ins)
    lines = [f"{sum(total.values())} instructions in {len(blocks)} blocks, {len(spans)} loops",
             "totals: " + ", ".join(f"{k} {v}" for k, v in total.most_common(top))]
    cold = first_cold(blocks)
    if cold < len(blocks):
        n = sum(len(ins) for _, ins in blocks[cold:])
        lines.append(f"out of line after the last EXIT: {len(blocks) - cold} blocks, {n} instructions")
    for i, (lab, ins) in enumerate(blocks):
        mix = collections.Counter(op.split(".")[0] for op, _ in ins)
        if len(ins) < min_size or (ops and not any(o in mix for o in ops)):
            continue
        notes = ["out of line"] if i >= cold else []
        for head, tail in spans:
            if head == i:
                body = sum(len(blocks[k][1]) for k in range(head, tail + 1))
                notes.append(f"loop head: {tail - head + 1} blocks, {body} instructions an iteration")
            elif head < i <= tail:
                notes.append(f"in the loop of {blocks[head][0]}")
        note = f"  [{'; '.join(notes)}]" if notes else ""
        lines.append(f"{lab}: {len(ins)}{note}  " + ", ".join(f"{k} {v}" for k, v in mix.most_common(top)))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", help="a cubin, or nvdisasm -c output")
    ap.add_argument("kernel", help="a substring of the kernel's mangled name")
    ap.add_argument("--ops", nargs="*", help="only blocks holding one of these opcodes (e.g. HMMA LDS)")
    ap.add_argument("--min", type=int, default=0, help="only blocks of at least this many instructions")
    args = ap.parse_args(argv)
    print(report(blocks_of(disassemble(args.binary), args.kernel), args.ops, args.min))
    return 0


if __name__ == "__main__":
    sys.exit(main())
