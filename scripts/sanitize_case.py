"""A small varlen prefill with empty and short sequences, for compute-sanitizer (memcheck/racecheck)."""
import os
import types

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


def random_decode_case(N, T, pool_rows, pool_dtype):
    """Random decode inputs for N requests of T tokens (H, D of the prefill above) on a pool of
    pool_rows rows: distinct write slots drawn from a random permutation of the pool ([N, T] int32),
    random acceptance in 1..T, and an output poisoned with NaN.  Callers pad requests or skip writes by
    setting slots to -1."""
    pool = (0.1 * torch.randn(pool_rows, H, D, D, device="cuda")).to(pool_dtype)
    q, k, v, g = (torch.randn(N, T, H, D, device="cuda").bfloat16() for _ in range(4))
    beta = torch.randn(N, T, H, device="cuda").bfloat16()
    out = torch.full((N, T, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(pool_rows, device="cuda")[:N * T].view(N, T).to(torch.int32)
    acc = torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32)
    return types.SimpleNamespace(q=q, k=k, v=v, g=g, beta=beta, out=out, pool=pool, slots=slots, acc=acc)


def decode_spec(c, ws):
    """Spec decode of all T tokens: 2-D slots, the starting state at slots[n, acc[n] - 1]."""
    torch.ops.flashkda.decode(c.q, c.k, c.v, c.g, c.beta, c.out, c.pool, c.slots, num_accepted_tokens=c.acc,
                              A_log=A_log, dt_bias=dt_bias, workspace=ws)


def decode_plain(c, ws, slots=None, out=None):
    """Plain decode of each request's first token: 1-D slots (column 0 unless given)."""
    slots = c.slots[:, 0].contiguous() if slots is None else slots
    out = c.out[:, :1] if out is None else out
    torch.ops.flashkda.decode(c.q[:, :1], c.k[:, :1], c.v[:, :1], c.g[:, :1], c.beta[:, :1], out, c.pool, slots,
                              A_log=A_log, dt_bias=dt_bias, workspace=ws)


# Decode: plain (1-D) and spec 1+3 (2-D, random acceptance, a padded request) on a bf16 and an fp32 pool.
dws = torch.empty(torch.ops.flashkda.get_decode_workspace_size(), dtype=torch.uint8, device="cuda")
for pool_dtype in (torch.float32, torch.bfloat16):
    c = random_decode_case(5, 4, 4 * 5 * 4, pool_dtype)
    c.slots[2, :] = -1
    decode_spec(c, dws)
    decode_plain(c, dws)
    torch.cuda.synchronize()
    print("decode", pool_dtype, "device error", flashkda.read_device_error(dws))

# Many plain requests in the fixed layout (beyond one wave: the plain stream kernel, chosen by default
# and forced; an A/B of another plain kernel behind the same switch gets checked too): a padded request
# and one whose slot is past the pool (reported, nothing written).
for pool_dtype in (torch.float32, torch.bfloat16):
    Np = 600
    c = random_decode_case(Np, 1, 2 * Np, pool_dtype)
    pslots = c.slots[:, 0].contiguous()
    pslots[7] = -1
    for kernel in ("auto", "stream"):
        os.environ["FLASHKDA_DECODE_KERNEL"] = kernel
        decode_plain(c, dws, pslots)
        torch.cuda.synchronize()
        print("plain stream", kernel, pool_dtype, "device error", flashkda.read_device_error(dws))
        bad = pslots.clone()
        bad[11] = 2 * Np
        decode_plain(c, dws, bad)
        torch.cuda.synchronize()
        print("plain stream", kernel, pool_dtype, "slot past the pool: device error",
              flashkda.read_device_error(dws), "(expected 2)")
    os.environ.pop("FLASHKDA_DECODE_KERNEL")

# Spec decode 1+3, then plain decode, on the pipelined kernel (forced): ~6 items a block, so every stage is
# reused; a padded request and a skipped write (slot -1) among them.  The small decode case above runs the
# one-wave kernels, and the fixed layout's default for many requests is the stream kernels.
os.environ["FLASHKDA_DECODE_KERNEL"] = "pipelined"
for pool_dtype in (torch.float32, torch.bfloat16):
    Ns = 200
    c = random_decode_case(Ns, 4, 5 * Ns, pool_dtype)
    c.slots[3, :] = -1
    c.slots[9, 2] = -1
    decode_spec(c, dws)
    torch.cuda.synchronize()
    print("spec pipelined", pool_dtype, "device error", flashkda.read_device_error(dws), "out NaN",
          int(c.out.isnan().sum()))
    pout1 = torch.full((Ns, 1, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    decode_plain(c, dws, out=pout1)
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
