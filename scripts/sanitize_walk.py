"""A varlen prefill for compute-sanitizer, sized by the command line, so that one walk configuration
runs under memcheck / racecheck on its own (scripts/sanitize_case.py starts with the same function):
    python3 scripts/sanitize_walk.py --H 40 --lens 0,5,64,0,130,1,17      # 8-warp walk, longest first
    python3 scripts/sanitize_walk.py --H 40 --lens 70,200                 # 8-warp walk, one wave
"""
import argparse
import types

import torch

import flashkda
from flashkda import reference as ref


def varlen_prefill(lens, H, D=128):
    """Runs the fwd op on random inputs of the given lengths and checks it against the reference;
    returns the inputs (cu_seqlens, beta, gate parameters, workspace) for further calls."""
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v, g = (torch.randn(1, T, H, D, device="cuda").bfloat16() for _ in range(4))
    beta = torch.randn(1, T, H, device="cuda").bfloat16()
    A_log, dt_bias = torch.rand(H, device="cuda"), torch.rand(H, D, device="cuda")
    h0 = 0.1 * torch.randn(N, H, D, D, device="cuda")
    out = torch.full((1, T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ht = torch.full_like(h0, float("nan"))
    ws = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda")
    torch.ops.flashkda.fwd(q, k, v, g, beta, D ** -0.5, out, ws, A_log, dt_bias, -5.0, h0, ht, cu)
    torch.cuda.synchronize()
    o_ref, s_ref = ref.prefill(q, k, v, g, beta, scale=D ** -0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                               initial_state=h0, cu_seqlens=cu)
    print(f"varlen prefill H{H} lens {lens}: out rel", ref.rel_err(out, o_ref), "state rel", ref.rel_err(ht, s_ref),
          flush=True)
    return types.SimpleNamespace(T=T, N=N, H=H, D=D, cu=cu, beta=beta, A_log=A_log, dt_bias=dt_bias, ws=ws)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", type=int, default=40)
    ap.add_argument("--lens", default="0,5,64,0,130,1,17")
    args = ap.parse_args()
    torch.manual_seed(0)
    varlen_prefill([int(x) for x in args.lens.split(",")], args.H)
