"""Probe: does a prefill call get faster when its chunk records stay in L2?

Today a call is chunk_prepare over every chunk-head (writing a 60 KB record each to the workspace),
then the state walk reading them back: on 8x2048 H16 ~250 MB each way through DRAM.  Split the same
work into S time slices (tokens [j L/S, (j+1) L/S) of every sequence, S calls, the state carried from
one to the next in place) and a slice's records are 1/S of that: at S >= 8 they fit in L2 (50 MB),
and slice j + 1 overwrites slice j's workspace lines while they are still there (no write-back).
This script times whole vs. sliced on the same inputs with the committed op, no kernel change, and
checks that the sliced outputs and final state equal the whole call's (chunk boundaries are the same,
the fp32 state round trip between slices is exact).

    python3 bench/probe_l2_tiling.py --json out.json

`--distinct-ws` adds a control: every slice its own workspace (records still hit L2 inside a slice,
but every dirty line is eventually written back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import D, LOWER_BOUND, by_label, copy_bandwidth, make_inputs, run_meta  # noqa: E402

import flashkda  # noqa: E402
from flashkda.timing import cuda_graph_kernel_times_us, cuda_graph_times_us  # noqa: E402

CASES = [("8x2048, H16", [2048] * 8, 16), ("4x8192, H16", [8192] * 4, 16), ("1x8192, H64", [8192], 64),
         ("64x256, H16", [256] * 64, 16)]


def call(x, cu, out, ws, h_in, h_out):
    torch.ops.flashkda.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], out, ws, scale=D ** -0.5,
                               gate_mode="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"],
                               lower_bound=LOWER_BOUND, cu_seqlens=cu, initial_state=h_in, final_state=h_out)


class Sliced:
    """The call as S slices of every sequence, state in place in `self.h` from slice 1 on."""

    def __init__(self, x, lens, H, S, distinct_ws):
        assert all(n % (64 * S) == 0 for n in lens), "slices must be whole chunks"
        N = len(lens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        self.rows, self.parts = [], []
        for j in range(S):
            rows = torch.cat([torch.arange(starts[i] + j * n // S, starts[i] + (j + 1) * n // S) for i, n in
                              enumerate(lens)]).cuda()
            part = {k: x[k][:, rows].contiguous() for k in ("q", "k", "v", "g", "beta")}
            part["A_log"], part["dt_bias"] = x["A_log"], x["dt_bias"]
            self.rows.append(rows)
            self.parts.append(part)
        Ts = sum(lens) // S
        self.cu = torch.tensor([sum(n // S for n in lens[:i]) for i in range(N + 1)], dtype=torch.int32,
                               device="cuda")
        self.outs = [torch.empty_like(p["v"]) for p in self.parts]
        nws = S if distinct_ws else 1
        size = flashkda.get_workspace_size(Ts, H, N)
        self.ws = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(nws)]
        self.h0 = x["h0"]
        self.h = torch.empty_like(x["h0"])

    def __call__(self):
        for j, p in enumerate(self.parts):
            call(p, self.cu, self.outs[j], self.ws[j % len(self.ws)], self.h0 if j == 0 else self.h, self.h)

    def gathered_out(self, like):
        out = torch.empty_like(like)
        for rows, o in zip(self.rows, self.outs):
            out[:, rows] = o
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="0,1,2,3")
    ap.add_argument("--slices", default="1,4,8,16,32")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--distinct-ws", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {"meta": run_meta() | {"copy_bandwidth_TBps": bw / 1e12}, "rows": []}
    print(res["meta"])
    for ci in [int(c) for c in args.cases.split(",")]:
        name, lens, H = CASES[ci]
        x = make_inputs(lens, H)
        N, T = len(lens), sum(lens)
        out = torch.empty_like(x["v"])
        ht = torch.empty_like(x["h0"])
        ws = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda")

        def whole():
            call(x, x["cu32"], out, ws, x["h0"], ht)

        whole()
        torch.cuda.synchronize()
        ref_out, ref_ht = out.clone(), ht.clone()
        for S in [int(s) for s in args.slices.split(",")]:
            if any(n % (64 * S) for n in lens):
                continue
            for distinct in ([False, True] if args.distinct_ws and S > 1 else [False]):
                fn = whole if S == 1 else Sliced(x, lens, H, S, distinct)
                if S > 1:  # poisoned outputs, then compare with the whole call
                    for o in fn.outs:
                        o.fill_(float("nan"))
                    fn.h.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    d_out = (fn.gathered_out(out).float() - ref_out.float()).abs().max().item()
                    d_ht = (fn.h - ref_ht).abs().max().item()
                else:
                    d_out = d_ht = 0.0
                t = statistics.median(cuda_graph_times_us(fn, args.iters))
                try:
                    kern = by_label(cuda_graph_kernel_times_us(fn, 10))
                except Exception as e:  # noqa: BLE001
                    kern = {"error": str(e)}
                row = {"case": name, "slices": S, "distinct_ws": distinct, "us": t, "max_abs_diff_out": d_out,
                       "max_abs_diff_state": d_ht, "kernels_us": kern}
                res["rows"].append(row)
                ks = ", ".join(f"{k.split('::')[-1]} {v:.1f}" for k, v in kern.items() if isinstance(v, float))
                print(f"{name:14s} S={S:2d}{' distinct-ws' if distinct else ''}: {t:8.1f} us  "
                      f"(diff out {d_out:.2e} state {d_ht:.2e})  [{ks}]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
