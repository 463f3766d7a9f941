"""A small varlen prefill with empty and short sequences, for compute-sanitizer (memcheck/racecheck)."""
import os

import torch

import flashkda
from flashkda import reference as ref

from sanitize_walk import varlen_prefill  # noqa: E402 (scripts/ is the script's own folder)

torch.manual_seed(0)
c = varlen_prefill([0, 5, 64, 0, 130, 1, 17], H=2)
T, N, H, D, cu, beta, A_log, dt_bias, ws = c.T, c.N, c.H, c.D, c.cu, c.beta, c.A_log, c.dt_bias, c.ws


# Prefill with checkpoints (mid-chunk, chunk-aligned, 0, the length), a state pool with padding and a
# scattered token_rows map: chunk_prepare, state_recurrence and checkpoint_advance.
P = 2 * N
pool = 0.1 * torch.randn(P, H, D, D, device="cuda")
idx = torch.randperm(P, device="cuda")[:N].to(torch.int32)
idx[3] = -1
offs = torch.tensor([[0, 0], [2, 5], [64, 64], [0, 0], [70, 130], [1, 1], [16, 17]], device="cuda", dtype=torch.int32)
ckpt = torch.full((N, 2, H, D, D), float("nan"), device="cuda")
R = T + 11
rows = torch.randperm(R, device="cuda")[:T].to(torch.int32)
big = [torch.randn(1, R, H, D, device="cuda").bfloat16() for _ in range(4)]
bigb = torch.randn(1, R, H, device="cuda").bfloat16()
out2 = torch.full((1, R, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
flashkda.prefill(*big, bigb, out2, ws, A_log=A_log, dt_bias=dt_bias, initial_state=pool, final_state=pool,
                 cu_seqlens=cu, state_indices=idx, checkpoint_offsets=offs, checkpoint_state=ckpt, token_rows=rows)
torch.cuda.synchronize()
print("prefill pool/checkpoints/token_rows: device error", flashkda.read_device_error(ws))

# Checkpoints under context parallelism (segments of one chunk forced): the segment walks store the
# checkpoints' chunk-boundary states, then checkpoint_advance (offsets inside segments and on their edges).
os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"] = "1"
ws_cp = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda")
qc, kc, vc, gc = (torch.randn(1, T, H, D, device="cuda").bfloat16() for _ in range(4))
out_cp = torch.full((1, T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
h0c = 0.1 * torch.randn(N, H, D, D, device="cuda")
ckpt_cp = torch.full((N, 2, H, D, D), float("nan"), device="cuda")
flashkda.prefill(qc, kc, vc, gc, beta, out_cp, ws_cp, A_log=A_log, dt_bias=dt_bias, initial_state=h0c,
                 final_state=torch.empty_like(h0c), cu_seqlens=cu, checkpoint_offsets=offs, checkpoint_state=ckpt_cp)
torch.cuda.synchronize()
del os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"]
print("prefill checkpoints, context parallel: device error", flashkda.read_device_error(ws_cp))

# Rows that are not 16-byte aligned (v a view at a 2-byte offset): chunk_prepare's unstaged loads and,
# where the walk reads v itself, its element-wise copies instead of bulk copies.
vbuf = torch.randn(T * H * D + 8, device="cuda").bfloat16()
v_odd = vbuf[1:1 + T * H * D].view(1, T, H, D)
qo, ko, go = (torch.randn(1, T, H, D, device="cuda").bfloat16() for _ in range(3))
out_odd = torch.full((1, T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
h0o = 0.1 * torch.randn(N, H, D, D, device="cuda")
flashkda.prefill(qo, ko, v_odd, go, beta, out_odd, ws, A_log=A_log, dt_bias=dt_bias, initial_state=h0o,
                 cu_seqlens=cu)
torch.cuda.synchronize()
o_ref, _ = ref.prefill(qo, ko, v_odd, go, beta, scale=D ** -0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                       initial_state=h0o, cu_seqlens=cu)
print("unaligned v rows: out rel", ref.rel_err(out_odd, o_ref), "device error", flashkda.read_device_error(ws))

# The duplicate pool-row check with its shared keys reused tile after tile: fixed length T = 0 gives
# chunk_prepare a one-block grid, whose block compares all 6 tiles of 600 sequences (one duplicate).
B0 = 600
z0 = torch.zeros(B0, 0, 1, 64, device="cuda", dtype=torch.bfloat16)
out0 = torch.zeros(B0, 0, 1, 64, device="cuda", dtype=torch.bfloat16)
pool0 = torch.zeros(B0 + 1, 1, 64, 64, device="cuda")
idx0 = torch.arange(B0, device="cuda", dtype=torch.int32)
idx0[599] = idx0[10]
ws0 = flashkda.new_workspace(z0)
flashkda.prefill(z0, z0, z0, z0, torch.zeros(B0, 0, 1, device="cuda", dtype=torch.bfloat16), out0, ws0,
                 A_log=torch.zeros(1, device="cuda"), dt_bias=torch.zeros(1, 64, device="cuda"), initial_state=pool0,
                 final_state=pool0, state_indices=idx0)
torch.cuda.synchronize()
print("duplicate pool rows, one-block grid: device error", flashkda.read_device_error(ws0), "(expected 6)")

# Decode: plain (1-D) and spec 1+3 (2-D, random acceptance, a padded request) on a bf16 and an fp32 pool.
dws = torch.empty(torch.ops.flashkda.get_decode_workspace_size(), dtype=torch.uint8, device="cuda")
for pool_dtype in (torch.float32, torch.bfloat16):
    Nd, Td = 5, 4
    dpool = (0.1 * torch.randn(4 * Nd * Td, H, D, D, device="cuda")).to(pool_dtype)
    dq, dk, dv, dg = (torch.randn(Nd, Td, H, D, device="cuda").bfloat16() for _ in range(4))
    db = torch.randn(Nd, Td, H, device="cuda").bfloat16()
    dout = torch.full((Nd, Td, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(4 * Nd * Td, device="cuda")[:Nd * Td].view(Nd, Td).to(torch.int32)
    slots[2, :] = -1
    acc = torch.randint(1, Td + 1, (Nd,), device="cuda", dtype=torch.int32)
    torch.ops.flashkda.decode(dq, dk, dv, dg, db, dout, dpool, slots, num_accepted_tokens=acc, A_log=A_log,
                              dt_bias=dt_bias, workspace=dws)
    torch.ops.flashkda.decode(dq[:, :1], dk[:, :1], dv[:, :1], dg[:, :1], db[:, :1], dout[:, :1], dpool,
                              slots[:, 0].contiguous(), A_log=A_log, dt_bias=dt_bias, workspace=dws)
    torch.cuda.synchronize()
    print("decode", pool_dtype, "device error", flashkda.read_device_error(dws))

# Many plain requests in the fixed layout (beyond one wave: the plain stream kernel, chosen by default
# and forced; an A/B of another plain kernel behind the same switch gets checked too): a padded request
# and one whose slot is past the pool (reported, nothing written).
for pool_dtype in (torch.float32, torch.bfloat16):
    Np = 600
    ppool = (0.1 * torch.randn(2 * Np, H, D, D, device="cuda")).to(pool_dtype)
    pq, pk, pv, pg = (torch.randn(Np, 1, H, D, device="cuda").bfloat16() for _ in range(4))
    pb = torch.randn(Np, 1, H, device="cuda").bfloat16()
    pout = torch.full((Np, 1, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    pslots = torch.randperm(2 * Np, device="cuda")[:Np].to(torch.int32)
    pslots[7] = -1
    for kernel in ("auto", "stream"):
        os.environ["FLASHKDA_DECODE_KERNEL"] = kernel
        torch.ops.flashkda.decode(pq, pk, pv, pg, pb, pout, ppool, pslots, A_log=A_log, dt_bias=dt_bias,
                                  workspace=dws)
        torch.cuda.synchronize()
        print("plain stream", kernel, pool_dtype, "device error", flashkda.read_device_error(dws))
        bad = pslots.clone()
        bad[11] = 2 * Np
        torch.ops.flashkda.decode(pq, pk, pv, pg, pb, pout, ppool, bad, A_log=A_log, dt_bias=dt_bias,
                                  workspace=dws)
        torch.cuda.synchronize()
        print("plain stream", kernel, pool_dtype, "slot past the pool: device error",
              flashkda.read_device_error(dws), "(expected 2)")
    os.environ.pop("FLASHKDA_DECODE_KERNEL")

# Spec decode 1+3, then plain decode, on the pipelined kernel (forced): ~6 items a block, so every stage is
# reused; a padded request and a skipped write (slot -1) among them.  The small decode case above runs the
# one-wave kernels, and the fixed layout's default for many requests is the stream kernels.
os.environ["FLASHKDA_DECODE_KERNEL"] = "pipelined"
for pool_dtype in (torch.float32, torch.bfloat16):
    Ns, Ts = 200, 4
    spool = (0.1 * torch.randn(5 * Ns, H, D, D, device="cuda")).to(pool_dtype)
    sq, sk, sv, sg = (torch.randn(Ns, Ts, H, D, device="cuda").bfloat16() for _ in range(4))
    sb = torch.randn(Ns, Ts, H, device="cuda").bfloat16()
    sout = torch.full((Ns, Ts, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    sslots = torch.randperm(5 * Ns, device="cuda")[:Ns * Ts].view(Ns, Ts).to(torch.int32)
    sslots[3, :] = -1
    sslots[9, 2] = -1
    sacc = torch.randint(1, Ts + 1, (Ns,), device="cuda", dtype=torch.int32)
    torch.ops.flashkda.decode(sq, sk, sv, sg, sb, sout, spool, sslots, num_accepted_tokens=sacc, A_log=A_log,
                              dt_bias=dt_bias, workspace=dws)
    torch.cuda.synchronize()
    print("spec pipelined", pool_dtype, "device error", flashkda.read_device_error(dws), "out NaN",
          int(sout.isnan().sum()))
    pout1 = torch.full((Ns, 1, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.ops.flashkda.decode(sq[:, :1], sk[:, :1], sv[:, :1], sg[:, :1], sb[:, :1], pout1, spool,
                              sslots[:, 0].contiguous(), A_log=A_log, dt_bias=dt_bias, workspace=dws)
    torch.cuda.synchronize()
    print("plain pipelined", pool_dtype, "device error", flashkda.read_device_error(dws), "out NaN",
          int(pout1.isnan().sum()))
os.environ.pop("FLASHKDA_DECODE_KERNEL")

# Context-parallel prefill (segment maps, segment_scan, segment walks), forced with segments of 1 chunk
# over the same sequences, in place on a pool with a padded sequence, D = 128 and D = 64.
os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"] = "1"
for Dc in (128, 64):
    qc, kc, vc, gc = (torch.randn(1, T, H, Dc, device="cuda").bfloat16() for _ in range(4))
    dtb = torch.rand(H, Dc, device="cuda")
    poolc = 0.1 * torch.randn(P, H, Dc, Dc, device="cuda")
    pool_ref = poolc.clone()
    outc = torch.full((1, T, H, Dc), float("nan"), device="cuda", dtype=torch.bfloat16)
    wsc = torch.empty(flashkda.get_workspace_size(T, H, N), dtype=torch.uint8, device="cuda")
    flashkda.prefill(qc, kc, vc, gc, beta, outc, wsc, A_log=A_log, dt_bias=dtb, initial_state=poolc,
                     final_state=poolc, cu_seqlens=cu, state_indices=idx)
    torch.cuda.synchronize()
    o_ref, s_ref = ref.prefill(qc, kc, vc, gc, beta, scale=Dc ** -0.5, A_log=A_log, dt_bias=dtb, lower_bound=-5.0,
                               initial_state=pool_ref, cu_seqlens=cu, state_indices=idx)
    print(f"context-parallel D={Dc}: out rel", ref.rel_err(outc, o_ref), "device error",
          flashkda.read_device_error(wsc))
del os.environ["FLASHKDA_PREFILL_SEGMENT_CHUNKS"]
