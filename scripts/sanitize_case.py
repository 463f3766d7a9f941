"""A small varlen prefill with empty and short sequences, for compute-sanitizer (memcheck/racecheck)."""
import torch

import flashkda
from flashkda import reference as ref

torch.manual_seed(0)
lens, H, D = [0, 5, 64, 0, 130, 1, 17], 2, 128
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
print("sanitize case: out rel", ref.rel_err(out, o_ref), "state rel", ref.rel_err(ht, s_ref))
