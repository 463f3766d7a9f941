#!/usr/bin/env python3
"""FlashKDA demo: one KDA prefill layer, timed and checked against the float64 reference.

Generates Kimi-style inputs (kda_spec.md section 6: q, k, v, g ~ N(0, 1) bf16, beta logits ~ N(0, 1),
A_log, dt_bias ~ U(0, 1), lower_bound -5, fp32 initial state ~ 0.1 N(0, 1)), runs
``flashkda.fwd`` (bounded gate, q/k l2norm and beta sigmoid fused; varlen via cu_seqlens), and
reports the time per call and the relative error of out and final_state against the float64
recurrence.  Uses the sm90 kernels when a GPU of compute capability 9.0 is present (timed with
CUDA events around CUDA-graph replays), the CPU implementation otherwise (timed with perf_counter).

    python3 examples/demo.py               # auto: GPU if available, else CPU
    python3 examples/demo.py --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import flashkda
from flashkda import reference as R
from flashkda.timing import cuda_graph_times_us, memory_floor_bytes

SPEC_OUT, SPEC_STATE = 4e-3, 3e-3
COPY_BW = 4.25e12  # H200 device-to-device copy bandwidth (read + write), bytes/s (kda_spec.md section 7)


def make_case(lens, H, D, device, gen):
    T = sum(lens)

    def randn(*s):
        return torch.randn(*s, generator=gen).to(device)

    q, k, v, g = (randn(1, T, H, D).to(torch.bfloat16) for _ in range(4))
    beta = randn(1, T, H).to(torch.bfloat16)
    A_log = torch.rand(H, generator=gen).to(device)
    dt_bias = torch.rand(H, D, generator=gen).to(device)
    h0 = 0.1 * randn(len(lens), H, D, D)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, cu_seqlens=cu)


def memory_floor_us(T, H, D, N):
    return memory_floor_bytes(T, H, D, N) / COPY_BW * 1e6


def run_case(name, lens, H, D, device, gen, iters, check=True):
    c = make_case(lens, H, D, device, gen)
    T, N = sum(lens), len(lens)
    out = torch.full((1, T, H, D), float("nan"), dtype=torch.bfloat16, device=device)
    fs = torch.full((N, H, D, D), float("nan"), dtype=torch.float32, device=device)
    ws = flashkda.new_workspace(c["q"], c["cu_seqlens"])

    def call():
        torch.ops.flashkda.fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], D ** -0.5, out, ws, c["A_log"],
                               c["dt_bias"], -5.0, c["initial_state"], fs, c["cu_seqlens"])

    call()  # first call: checked below, also a warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        err = flashkda.read_device_error(ws)
        if err:
            raise RuntimeError(f"device error {err}: {flashkda.DEVICE_ERRORS.get(err)}")
    res = {"case": name, "T": T, "N": N, "H": H, "D": D}
    if check:
        t0 = time.perf_counter()
        ref_out, ref_fs = R.prefill(c["q"], c["k"], c["v"], c["g"], c["beta"], A_log=c["A_log"],
                                    dt_bias=c["dt_bias"], initial_state=c["initial_state"],
                                    cu_seqlens=c["cu_seqlens"])
        res["ref_s"] = time.perf_counter() - t0
        res["out_rel"] = R.rel_err(out, ref_out)
        res["state_rel"] = R.rel_err(fs, ref_fs)

    times = []
    if device == "cuda":
        times = cuda_graph_times_us(call, iters)
        res["floor_us"] = memory_floor_us(T, H, D, N)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
    res["us"] = statistics.median(times)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=0, help="timed calls per case (default: 3 on CPU, 50 on GPU)")
    args = ap.parse_args()

    # The kernels are sm_90a: compute capability 9.0 exactly (H100, H200, H20).
    gpu_ok = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
              and flashkda.built_with_cuda())
    device = args.device
    if device == "auto":
        device = "cuda" if gpu_ok else "cpu"
    if device == "cuda" and not gpu_ok:
        print("flashkda demo: --device cuda needs a GPU of compute capability 9.0 and a CUDA build",
              file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    iters = args.iters or (3 if device == "cpu" else 50)

    print(f"flashkda {flashkda.__version__} | torch {torch.__version__} | device: "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (C++ reference implementation)'}")
    cases = [("varlen [300,17,64,131] H4", [300, 17, 64, 131], 4, 128, True)]
    if device == "cuda":
        cases += [
            ("8x2048 H16", [2048] * 8, 16, 128, True),
            ("4x8192 H16", [8192] * 4, 16, 128, False),
            ("1x8192 H96", [8192], 96, 128, False),
            ("[1300,547,2048,963,271,3063] H96", [1300, 547, 2048, 963, 271, 3063], 96, 128, False),
            ("64x256 H16", [256] * 64, 16, 128, False),
        ]
    ok = True
    header = f"{'case':36s} {'tokens':>7s} {'time/call':>12s}"
    header += f" {'mem floor':>10s}" if device == "cuda" else ""
    header += f" {'out rel':>9s} {'state rel':>9s}"
    print(header)
    for name, lens, H, D, check in cases:
        r = run_case(name, lens, H, D, device, gen, iters, check)
        line = f"{name:36s} {r['T']:7d} {r['us']:10.1f}us"
        if device == "cuda":
            line += f" {r['floor_us']:8.1f}us"
        if check:
            line += f" {r['out_rel']:9.2e} {r['state_rel']:9.2e}"
            ok &= r["out_rel"] <= SPEC_OUT and r["state_rel"] <= SPEC_STATE
        else:
            line += f" {'-':>9s} {'-':>9s}"
        print(line, flush=True)
    print(f"errors vs the float64 reference within the spec bounds (out <= {SPEC_OUT}, state <= {SPEC_STATE}): "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
