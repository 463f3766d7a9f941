"""Decode chunk_prepare's per-chunk records from the workspace and compare them with a float64
computation of the same quantities (spec section 3), then the op's output with the reference.

A GPU debugging aid (run on the H200): it tells whether a wrong result comes from chunk_prepare
(records) or from state_recurrence (output / state given correct records).

    python3 scripts/debug_records.py [--T 130] [--H 2] [--D 128] [--gate bounded]
"""

import argparse
import math
import os
import sys

import torch

import flashkda
from flashkda import reference as ref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import record_oracle as O  # noqa: E402

C = 64


def record_views(ws: torch.Tensor, slot: int, h: int, H: int, D: int):
    """The true tiles of one record (shifts undone), read by the GPU tests' record model
    (tests/python/record_oracle.py: KT / QT / KD SW128 images, TB / MQK packed triangles)."""
    rec = O.unshifted(O.read_record(ws.view(torch.uint8), slot, h, H, D))
    return {name: rec[name] for name in ("KT", "QT", "KD", "TB", "MQK", "gamma")}


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
