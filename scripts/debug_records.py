"""Decode chunk_prepare's per-chunk records from the workspace and compare them with a float64
computation of the same quantities (spec section 3), then the op's output with the reference.

A GPU debugging aid (run on the H200): it tells whether a wrong result comes from chunk_prepare
(records) or from state_recurrence (output / state given correct records).

    python3 scripts/debug_records.py [--T 130] [--H 2] [--D 128] [--gate bounded]
"""

import argparse
import math

import torch

import flashkda
from flashkda import reference as ref

C = 64


def sw128_index(rows: int, cols: int) -> torch.Tensor:
    """Flat element index of (r, col) in the SW128 image of a 16-bit [rows][cols] tile (kda_sw128.h's
    sw128_element): 64-column halves of rows x 128 bytes, the 16-byte pieces of a row XOR-ed by r & 7."""
    r = torch.arange(rows)[:, None]
    col = torch.arange(cols)[None, :]
    byte = (col >> 6) * (rows * 128) + r * 128 + ((((col & 63) >> 3) ^ (r & 7)) << 4)
    return byte // 2 + (col & 7)


def unswizzle(t: torch.Tensor) -> torch.Tensor:
    """The row-major [rows][cols] matrix of a record tile stored as its SW128 image."""
    rows, cols = t.shape
    return t.reshape(-1)[sw128_index(rows, cols).to(t.device)]


def record_views(ws: torch.Tensor, slot: int, h: int, H: int, D: int):
    rec_bytes = 3 * C * D * 2 + 2 * C * C * 2 + D * 4 + 128
    base = 4096 + (slot * H + h) * rec_bytes  # after the error header (kWorkspaceHeaderBytes)
    raw = ws.view(torch.uint8)[base: base + rec_bytes]
    off = 0

    def take(nbytes, dtype, shape):
        nonlocal off
        t = raw[off: off + nbytes].view(dtype).reshape(shape)
        off += nbytes
        return t

    KT = unswizzle(take(C * D * 2, torch.bfloat16, (C, D)))
    QT = unswizzle(take(C * D * 2, torch.bfloat16, (C, D)))
    KD = unswizzle(take(C * D * 2, torch.float16, (C, D)))
    TB = unswizzle(take(C * C * 2, torch.float16, (C, C)))
    MQK = unswizzle(take(C * C * 2, torch.float16, (C, C)))
    gamma = take(D * 4, torch.float32, (D,))
    tb_s, mqk_s, kd_s = (int(x) for x in take(12, torch.int32, (3,)).tolist())
    return dict(KT=KT, QT=QT, KD=KD.double() * 2.0 ** kd_s, TB=TB.double() * 2.0 ** tb_s,
                MQK=MQK.double() * 2.0 ** mqk_s, gamma=gamma)


def expected_records(q, k, v, a, b, scale):
    """float64 record of one chunk: q, k, a [L, D] (preprocessed), v [L, D], b [L]."""
    L, D = q.shape
    pad = C - L
    z = lambda x: torch.cat([x, x.new_zeros((pad,) + x.shape[1:])]) if pad else x
    q, k, v, a, b = z(q), z(k), z(v), z(a), z(b)
    G = a.cumsum(0)
    Gl = G[-1]
    kt = k * G.exp()
    qt = scale * q * G.exp()
    kd = k * (Gl - G).exp()
    diff = (G[:, None, :] - G[None, :, :])  # [i, j, D]
    mask_strict = torch.tril(torch.ones(C, C, dtype=torch.bool), -1)
    mask_incl = torch.tril(torch.ones(C, C, dtype=torch.bool), 0)
    e = torch.where(mask_incl[..., None], diff, torch.full_like(diff, -math.inf)).exp()
    KK = torch.einsum("id,jd,ijd->ij", k, k, e)
    QK = torch.einsum("id,jd,ijd->ij", q, k, e)
    Lm = torch.where(mask_strict, b[:, None] * KK, torch.zeros_like(KK))
    Mqk = torch.where(mask_incl, scale * QK, torch.zeros_like(QK))
    Tinv = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + Lm)
    return dict(KT=kt, QT=qt, KD=kd, TB=Tinv * b[None, :], MQK=Mqk, gamma=Gl.exp())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=130)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--gate", default="bounded")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    T, H, D = args.T, args.H, args.D
    q = torch.randn(1, T, H, D, device=dev).bfloat16()
    k = torch.randn(1, T, H, D, device=dev).bfloat16()
    v = torch.randn(1, T, H, D, device=dev).bfloat16()
    g = torch.randn(1, T, H, D, device=dev).bfloat16()
    if args.gate == "precomputed":
        g = (-torch.rand(1, T, H, D, device=dev) * 0.5).bfloat16()
    beta = torch.randn(1, T, H, device=dev).bfloat16()
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    h0 = 0.1 * torch.randn(1, H, D, D, device=dev)
    out = torch.full((1, T, H, D), float("nan"), device=dev, dtype=torch.bfloat16)
    ht = torch.full((1, H, D, D), float("nan"), device=dev)
    ws = torch.zeros(flashkda.get_workspace_size(T, H, 1), dtype=torch.uint8, device=dev)
    scale = D ** -0.5
    torch.ops.flashkda.prefill(q, k, v, g, beta, out, ws, scale=scale, gate_mode=args.gate, A_log=A_log,
                               dt_bias=dt_bias, lower_bound=-5.0, initial_state=h0, final_state=ht)
    torch.cuda.synchronize()
    print("device error word:", int(ws[:4].view(torch.int32).item()))

    qf = ref.l2norm(q[0].double())
    kf = ref.l2norm(k[0].double())
    af = ref.gate_log_decay(g[0], args.gate, A_log, dt_bias, -5.0)
    bf = torch.sigmoid(beta[0].double())
    for h in range(H):
        for c in range((T + C - 1) // C):
            s, e = c * C, min(T, c * C + C)
            exp = expected_records(qf[s:e, h].cpu(), kf[s:e, h].cpu(), v[0, s:e, h].double().cpu(),
                                   af[s:e, h].cpu(), bf[s:e, h].cpu(), scale)
            got = record_views(ws, c, h, H, D)
            line = [f"h{h} c{c}"]
            for name, x in exp.items():
                y = got[name].double().cpu()
                err = (y - x).norm() / max(x.norm().item(), 1e-30)
                line.append(f"{name} {err:.2e}")
            print("  ".join(line))
    o_ref, s_ref = ref.prefill(q, k, v, g, beta, scale=scale, gate_mode=args.gate, A_log=A_log, dt_bias=dt_bias,
                               lower_bound=-5.0, initial_state=h0)
    print("out rel", ref.rel_err(out, o_ref), "state rel", ref.rel_err(ht, s_ref),
          "out NaN", int(torch.isnan(out).sum()), "state NaN", int(torch.isnan(ht).sum()))
    # Per-chunk output error, to see where it starts going wrong.
    for c in range((T + C - 1) // C):
        s, e = c * C, min(T, c * C + C)
        print(f"  out chunk {c}: rel {ref.rel_err(out[:, s:e], o_ref[:, s:e]):.3e}")


if __name__ == "__main__":
    main()
