"""One decode configuration run a few times, for Nsight Compute (scripts/gpu_run.sh NCU=1):
python3 scripts/profile_decode.py [N] [T] [pool dtype: fp32|bf16] [impl: ours|fla]."""
import sys

import torch

import flashkda

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
T = int(sys.argv[2]) if len(sys.argv) > 2 else 1
dtype = torch.bfloat16 if len(sys.argv) > 3 and sys.argv[3] == "bf16" else torch.float32
impl = sys.argv[4] if len(sys.argv) > 4 else "ours"
H, D = 16, 128
torch.manual_seed(0)
q, k, v, g = (torch.randn(N, T, H, D, device="cuda").bfloat16() for _ in range(4))
beta = torch.randn(N, T, H, device="cuda").bfloat16()
A_log, dt_bias = torch.rand(H, device="cuda"), torch.rand(H, D, device="cuda")
pool = (0.1 * torch.randn(8 * N, H, D, D, device="cuda")).to(dtype)
perm = torch.randperm(8 * N, device="cuda").to(torch.int32)
out = torch.empty(N, T, H, D, device="cuda", dtype=torch.bfloat16)
ws = torch.zeros(torch.ops.flashkda.get_decode_workspace_size(), dtype=torch.uint8, device="cuda")
if T == 1:
    idx, acc = perm[:N].contiguous(), None
else:
    idx, acc = perm[:N * T].view(N, T).contiguous(), torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32)
for _ in range(5):
    if impl == "ours":
        torch.ops.flashkda.decode(q, k, v, g, beta, out, pool, idx, num_accepted_tokens=acc, A_log=A_log,
                                  dt_bias=dt_bias, workspace=ws)
    else:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        cu = torch.arange(0, N * T + 1, T, device="cuda", dtype=torch.int64)
        fused_recurrent_kda_fwd(q.view(1, N * T, H, D), k.view(1, N * T, H, D), v.view(1, N * T, H, D),
                                g.view(1, N * T, H, D), beta.view(1, N * T, H), A_log=A_log, dt_bias=dt_bias,
                                scale=D ** -0.5, initial_state=pool, output_final_state=False, inplace_final_state=True, state_v_first=True,
                                cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=acc,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=out.view(1, N * T, H, D))
torch.cuda.synchronize()
print("done", impl, N, T, dtype)
