"""One prefill call of a benchmark case, for Nsight Compute (ncu) or compute-sanitizer.

    ncu --clock-control none -k regex:chunk_prepare -c 1 --section SpeedOfLight python3 scripts/profile_case.py 0
    ncu -k regex:checkpoint_advance -c 1 ... python3 scripts/profile_case.py 3 checkpoints

The optional second argument is one of bench_prefill's serving variants (bf16_state, pool, checkpoints,
...): the call then goes through flashkda.prefill with that feature on.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_prefill import CASES, Ours, OursVariant, make_inputs  # noqa: E402

name, lens, H = CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
x = make_inputs(lens, H)
call = OursVariant(x, H, sys.argv[2]) if len(sys.argv) > 2 else Ours(x, H)
call()
torch.cuda.synchronize()
print("profiled", name, sys.argv[2] if len(sys.argv) > 2 else "")
