"""One prefill call of a benchmark case, for Nsight Compute (ncu) or compute-sanitizer.

    ncu --clock-control none -k regex:chunk_prepare -c 1 --section SpeedOfLight python3 scripts/profile_case.py 0
"""
import sys

import torch

sys.path.insert(0, "bench")
from bench_prefill import CASES, Ours, make_inputs  # noqa: E402

name, lens, H = CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
ours = Ours(make_inputs(lens, H), H)
ours()
torch.cuda.synchronize()
print("profiled", name)
