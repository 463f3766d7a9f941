#!/usr/bin/env python3
"""CPU numerics study of the chunked KDA prefill kernel (C = 64, K = V = 128), float64 emulation.

Emulates, chunk by chunk, the algorithm of the sm90 kernel (kda_spec.md section 3) with explicit
rounding of every stored / tensor-core-operand quantity, and measures rel error of out (bf16) and
final_state against the float64 recurrence of python/flashkda/reference.py.

Rounding kinds: fp64 (identity), fp32, bf16, fp16, hilo (bf16 hi + bf16 lo of the remainder).
Knobs (all "records" of the kernel):
  QT, KD, MQK, TINV, W, U, S (state as tensor-core operand), VN (Vn as tensor-core operand)
  OP   rounding of the fixed bf16 tensor-core operands (L/MQK factors, b*k*exp(G), b*v)
  ACC  fp32 math/accumulate of the kernel (prepare in fp32, fp32 results of every product)
  OUT  final output rounding (bf16)

Fixed operands (bf16 in the current kernel, varied in (4b)-(6)):
  FOFF / FDIAG  bf16 factors of the off-diagonal / diagonal 16x16 blocks of L and MQK
  BK, BV        b*k*exp(G) and b*v, second operands of W = T_inv @ bk, U = T_inv @ bv
  FOLD          fold diag(b) into T_inv instead (U = (T_inv diag b) @ v with v exact)

Recommended ("R" below; each MMA's two operands share a type, fp16 MMA costs the same as bf16):
  fp16: T_inv, b*k*exp(G), b*v (so W, U come from fp16 MMAs), U record, MQK, Vn operand, KD
  bf16: QT, W, S operand (QT @ S^T and W @ S^T stay bf16 MMAs; S hi/lo split not needed)
  tf32 (or fp32 CUDA cores / hilo): the factors of the 4 diagonal 16x16 blocks of L and MQK
  bf16: the factors of the 6 off-diagonal blocks (all <= 1 there); fp16 since 2675e7c when q, k are
        l2-normalised ((7) below)

Usage: python3 scripts/numerics_study.py [--quick]   (about 25 s on 2 CPU cores)
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import time
import types

import torch

torch.set_num_threads(2)

# flashkda/__init__ loads the compiled op library; reference.py (and host_checks.py, which it imports)
# only need torch, so they are imported through a bare package module whose __init__ never runs.
_pkg = types.ModuleType("flashkda")
_pkg.__path__ = [str(pathlib.Path(__file__).resolve().parents[1] / "python" / "flashkda")]
sys.modules.setdefault("flashkda", _pkg)
ref = importlib.import_module("flashkda.reference")

C = 64
BLK = 16
KDIM = VDIM = 128
LOWER_BOUND = -5.0


# ----------------------------------------------------------------------------------------- rounding
def rnd(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp64":
        return x
    if kind == "fp32":
        return x.float().double()
    if kind == "bf16":
        return x.to(torch.bfloat16).double()
    if kind == "fp16":
        return x.to(torch.float16).double()
    if kind in ("tf32", "fp16s"):  # 10 explicit mantissa bits, fp32 range (round to nearest even); fp16s:
        # fp16 under a power-of-two shift, the same mantissa without fp16's range limits
        xi = x.float().view(torch.int32).long()
        xi = (xi + 0xFFF + ((xi >> 13) & 1)) & ~0x1FFF  # two's complement: fine for negative values
        return xi.to(torch.int32).view(torch.float32).double()
    if kind == "hilo":
        x = x.float()  # the kernel splits an fp32 value
        hi = x.to(torch.bfloat16)
        lo = (x - hi.float()).to(torch.bfloat16)
        return hi.double() + lo.double()
    raise ValueError(kind)


KNOBS = ("QT", "KD", "MQK", "TINV", "W", "U", "S", "VN")


def config(base: str = "bf16", op: str = "bf16", acc: str = "fp32", out: str = "bf16", **kw) -> dict:
    cfg = {k: base for k in KNOBS}
    cfg.update(FOFF=op, FDIAG=op, BK=op, BV=op, ACC=acc, OUT=out, FOLD=False, FSHARE=False, WUWALK=False,
               KTOP="fp16", XOP="fp16", UWALK=False, PWALK=False, WTOP="bf16", VNOP="")
    for k, v in kw.items():
        assert k in cfg, k
        cfg[k] = v
    return cfg


# ------------------------------------------------------------------------------------------- inputs
def make_inputs(seqlens, H, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(seqlens)
    N = len(seqlens)
    q = torch.randn(1, T, H, KDIM, generator=gen).bfloat16()
    k = torch.randn(1, T, H, KDIM, generator=gen).bfloat16()
    v = torch.randn(1, T, H, VDIM, generator=gen).bfloat16()
    g = torch.randn(1, T, H, KDIM, generator=gen).bfloat16()
    beta = torch.randn(1, T, H, generator=gen).bfloat16()
    A_log = torch.rand(H, generator=gen)
    dt_bias = torch.rand(H, KDIM, generator=gen)
    h0 = 0.1 * torch.randn(N, H, VDIM, KDIM, generator=gen)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(seqlens), 0).tolist()), dtype=torch.long)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, cu=cu)


def reference(inp):
    out, fin = ref.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], gate_mode="bounded",
                           A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND,
                           initial_state=inp["h0"], cu_seqlens=inp["cu"])
    return out, fin


def to_chunks(x, cu, nC):
    """[1, T, H, D] -> [N, nC, H, C, D] zero padded (pad rows are zero)."""
    x = x[0]
    N = cu.numel() - 1
    H, D = x.shape[1], x.shape[2]
    outp = torch.zeros(N, nC * C, H, D, dtype=x.dtype)
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        outp[n, : e - s] = x[s:e]
    return outp.reshape(N, nC, C, H, D).permute(0, 1, 3, 2, 4).contiguous()


def from_chunks(o, cu):
    """[N, nC, H, C, V] -> [1, T, H, V]."""
    N, nC, H, _, V = o.shape
    o = o.permute(0, 1, 3, 2, 4).reshape(N, nC * C, H, V)
    parts = [o[n, : int(cu[n + 1]) - int(cu[n])] for n in range(N)]
    return torch.cat(parts, 0)[None]


# -------------------------------------------------------------------------------------- emulation
def pow2_shift(m: torch.Tensor, target: int) -> torch.Tensor:
    """The kernel's pow2_shift: s with m 2^-s < 2^target (floor(log2 m) + 1 - target), in [-60, 60], 0 for m == 0."""
    e = torch.floor(torch.log2(m.clamp_min(1e-300)))
    return torch.where(m > 0, (e + 1 - target).clamp(-60, 60), torch.zeros_like(e))


def _warp_groups(t: torch.Tensor) -> torch.Tensor:
    """[.., V] -> [.., V/16, 16]: a warp's 16 state rows are 16 v columns of XT / VnT [.., C, V]."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // 16, 16)


def x_shift(X, v_c, S, k_c, bound: bool) -> torch.Tensor:
    """XT's power-of-two shift per warp and chunk [N, H, V/16], target 2^15: from XT's maximum (main) or
    from the bound |v| + ||S_r||_1 2^shift_d that experiments/walk-xt-bound.patch forms before XT exists."""
    if bound:
        vmax = _warp_groups(v_c.double().abs()).amax(dim=(-3, -1))  # [N, H, V/16]
        s1 = _warp_groups(S.abs().sum(-1)).amax(-1)  # [N, H, V/16]: max over the warp's rows of ||S_r||_1
        kb = torch.exp2(pow2_shift(k_c.double().abs().amax(dim=(-2, -1)), 0))[..., None]  # [N, H, 1]
        m = vmax + s1 * kb
    else:
        m = _warp_groups(X.abs()).amax(dim=(-3, -1))
    return pow2_shift(m, 15)


def fp16_shifted(X: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """X [.., C, V] as true fp16 (range and subnormals) under the per-warp shift sh [.., V/16]."""
    scale = torch.exp2(sh).repeat_interleave(16, dim=-1)[..., None, :]  # [N, H, 1, V]
    return (X / scale).to(torch.float16).double() * scale


def emulate(inp, cfg, ranges=None):
    cu = inp["cu"]
    lens = (cu[1:] - cu[:-1]).tolist()
    nC = max(1, max((l + C - 1) // C for l in lens))
    H = inp["q"].shape[2]
    scale = KDIM ** -0.5
    wdt = torch.float32 if cfg["ACC"] == "fp32" else torch.float64  # the kernel's "fp32" math dtype
    R = lambda x, key: rnd(x, cfg[key])  # noqa: E731
    A = lambda x: rnd(x, cfg["ACC"])  # noqa: E731  fp32 result of a product / fp32 register value

    # ---- token-wise preprocessing in fp32 (pad rows stay zero: q=k=v=0, a=0, b=0)
    q = ref.l2norm(inp["q"].to(wdt))
    k = ref.l2norm(inp["k"].to(wdt))
    v = inp["v"].to(wdt)
    Aexp = torch.exp(inp["A_log"].to(wdt)).reshape(H, 1)
    a = LOWER_BOUND * torch.sigmoid(Aexp * (inp["g"].to(wdt) + inp["dt_bias"].to(wdt).reshape(H, KDIM)))
    b = torch.sigmoid(inp["beta"].to(wdt))[..., None]
    q, k, v, a = (to_chunks(x, cu, nC) for x in (q, k, v, a))
    b = to_chunks(b, cu, nC)  # [N, nC, H, C, 1]
    G = torch.cumsum(a, dim=-2)  # fp32 cumsum over the chunk
    Glast = G[..., -1:, :]

    QT = R((scale * q * torch.exp(G)).double(), "QT")
    KD = R((k * torch.exp(Glast - G)).double(), "KD")
    gamma = torch.exp(Glast).double()  # [N, nC, H, 1, K]

    # ---- L and MQK from bf16 factors with a per-16x16-block reference row
    L = torch.zeros(*q.shape[:-1], C, dtype=torch.float64)
    MQK = torch.zeros_like(L)
    nb = C // BLK
    for I in range(nb):
        rows = slice(BLK * I, BLK * I + BLK)
        for J in range(I + 1):
            cols = slice(BLK * J, BLK * J + BLK)
            r = BLK * I - 1 if I > J else BLK * I + 7
            fop = cfg["FOFF"] if I > J else cfg["FDIAG"]
            Gr = G[..., r : r + 1, :]
            if I > J and cfg["FSHARE"]:
                # shared factors: A_I (reference row 16I-1, shared by every J), B_J (reference 16J+15,
                # shared by every I), and the per-column gap 2^(G_{16I-1} - G_{16J+15}) <= 1 applied
                # to A_I as a rounded product (1 for J = I-1)
                Gj = G[..., BLK * J + BLK - 1 : BLK * J + BLK, :]
                gap = rnd(torch.exp(Gr - Gj).double(), fop)
                fk_i = rnd(rnd((k[..., rows, :] * torch.exp(G[..., rows, :] - Gr)).double(), fop) * gap, fop)
                fq_i = rnd(rnd((q[..., rows, :] * torch.exp(G[..., rows, :] - Gr)).double(), fop) * gap, fop)
                fk_j = rnd((k[..., cols, :] * torch.exp(Gj - G[..., cols, :])).double(), fop)
            else:
                fk_i = rnd((k[..., rows, :] * torch.exp(G[..., rows, :] - Gr)).double(), fop)
                fq_i = rnd((q[..., rows, :] * torch.exp(G[..., rows, :] - Gr)).double(), fop)
                fk_j = rnd((k[..., cols, :] * torch.exp(Gr - G[..., cols, :])).double(), fop)
            if ranges is not None:
                key = "fac_off" if I > J else "fac_diag"
                fmax = max(float(fk_i.abs().max()), float(fq_i.abs().max()), float(fk_j.abs().max()))
                ranges[key] = max(ranges.get(key, 0.0), fmax)
            L[..., rows, cols] = A(fk_i @ fk_j.transpose(-1, -2))
            MQK[..., rows, cols] = A(fq_i @ fk_j.transpose(-1, -2))
    L = A(b.double() * L).tril(-1)
    MQK = R(A(scale * MQK).tril(0), "MQK")

    eye = torch.eye(C, dtype=torch.float64)
    Tinv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    Tinv_exact = Tinv
    if cfg["FOLD"]:
        # fold diag(b) into T_inv: W = (T_inv diag(b)) @ (k exp(G)), U = (T_inv diag(b)) @ v (v exact in bf16)
        Tinv = R(A(Tinv * b.double().transpose(-1, -2)), "TINV")
        bk = rnd((k * torch.exp(G)).double(), cfg["BK"])
        bv = v.double()
    else:
        Tinv = R(A(Tinv), "TINV")
        bk = rnd((b * k * torch.exp(G)).double(), cfg["BK"])
        bv = rnd((b * v).double(), cfg["BV"])
    W = R(A(Tinv @ bk), "W")
    U = R(A(Tinv @ bv), "U")
    if cfg["WUWALK"] or cfg["UWALK"] or cfg["PWALK"]:
        # W and U never formed (the FlashKDA-peer scheme): the walk computes X = v - kt S^T and
        # Vn = (T_inv diag(b)) X, from the records kt (KTOP) and Tb = T_inv diag(b) (TINV, fp16 with a
        # power-of-two shift as today), X rounded to the operand type XOP (fp16s: fp16 with a per-warp
        # shift).
        Tb = R(A(Tinv_exact * b.double().transpose(-1, -2)), "TINV")
        kt_rec = rnd((k * torch.exp(G)).double(), cfg["KTOP"])
        v_in = v.double()

    if ranges is not None:
        for name, x in (("QT", QT), ("KD", KD), ("MQK", MQK), ("TINV", Tinv), ("W", W), ("U", U),
                        ("b*k*e^G", bk), ("b*v", bv)):
            ranges[name] = max(ranges.get(name, 0.0), float(x.abs().max()))

    # ---- recurrence over chunks, batched over sequences and heads
    S = inp["h0"].double().clone()  # [N, H, V, K] fp32 values
    S = A(S)
    O = torch.empty(*QT.shape[:-1], VDIM, dtype=torch.float64)
    smax = vnmax = 0.0
    for c in range(nC):
        Vn_op = None  # set by a walk that models VnT's fp16 shift (VNOP), else R(Vn, "VN") below
        Sop = R(S, "S")
        SopT = Sop.transpose(-1, -2)  # [N, H, K, V]
        if cfg["PWALK"]:  # the producer warpgroup: W^T = kt^T Tb^T rounded to WTOP, U^T = v^T Tb^T fp32
            Wp = rnd(A(Tb[:, c] @ kt_rec[:, c]), cfg["WTOP"])
            Vn = A(A(Tb[:, c] @ v_in[:, c]) - Wp @ SopT)
        elif cfg["UWALK"]:  # U = Tb v in the walk (v exact, Tb fp16 with a shift), W from the record
            Vn = A(Tb[:, c] @ v_in[:, c] - W[:, c] @ SopT)
        elif cfg["WUWALK"]:
            X = A(v_in[:, c] - kt_rec[:, c] @ SopT)
            if cfg["XOP"] in ("fp16m", "fp16b"):
                sh_x = x_shift(X, v_in[:, c], S, k[:, c], cfg["XOP"] == "fp16b")
                Xop = fp16_shifted(X, sh_x)
            else:
                Xop = rnd(X, cfg["XOP"])
            Vn = A(Tb[:, c] @ Xop)
            if cfg["VNOP"]:
                assert cfg["VNOP"] in ("fp16m", "fp16st") and cfg["XOP"] in ("fp16m", "fp16b"), "VNOP needs XT's shift"
                # VnT's fp16 operand under the kernel's shifts: XT's (sh_x), Tb's record shift (|Tb'| < 2)
                # and shift_n, from VnT's maximum (main, target 2^14) or the static 8 of
                # experiments/walk-vnt-static.patch (|VnT'| < 2^15 * 2 * 64 = 2^22)
                sh_t = pow2_shift(Tb[:, c].abs().amax(dim=(-2, -1)), 1)[..., None]  # [N, H, 1]
                if cfg["VNOP"] == "fp16st":
                    sh_n = torch.full_like(sh_x, 8.0)
                else:
                    sh_n = pow2_shift(_warp_groups(Vn.abs()).amax(dim=(-3, -1)) * torch.exp2(-(sh_x + sh_t)), 14)
                Vn_op = fp16_shifted(Vn, sh_x + sh_t + sh_n)
        else:
            Vn = A(U[:, c] - W[:, c] @ SopT)
        if Vn_op is None:
            Vn_op = R(Vn, "VN")
        O[:, c] = A(QT[:, c] @ SopT + MQK[:, c] @ Vn_op)
        S = A(S * gamma[:, c] + Vn_op.transpose(-1, -2) @ KD[:, c])
        smax = max(smax, float(S.abs().max()))
        vnmax = max(vnmax, float(Vn.abs().max()))
    if ranges is not None:
        ranges["S"] = max(ranges.get("S", 0.0), smax)
        ranges["VN"] = max(ranges.get("VN", 0.0), vnmax)
    out = rnd(from_chunks(O, cu), cfg["OUT"])
    return out, S


# ------------------------------------------------------------------------------------------ driver
SEQLENS = [300, 17, 64, 131]
H = 4
SEEDS = (0, 1, 2)


def run(cfgs, cases, ranges=None):
    res = {}
    for name, cfg in cfgs:
        eo, es = [], []
        for inp, (ro, rs) in cases:
            o, s = emulate(inp, cfg, ranges)
            eo.append(ref.rel_err(o, ro))
            es.append(ref.rel_err(s, rs))
        res[name] = (sum(eo) / len(eo), sum(es) / len(es))
        print(f"{name:48s} out {res[name][0]:.3e}  state {res[name][1]:.3e}", flush=True)
    return res


def main():
    t0 = time.time()
    cases = []
    for s in SEEDS:
        inp = make_inputs(SEQLENS, H, s)
        cases.append((inp, reference(inp)))
    print(f"# reference done in {time.time() - t0:.1f}s; varlen {SEQLENS}, H={H}, seeds {SEEDS}; mean of seeds")

    print("# --- validation (emulated chunk algorithm vs float64 recurrence) and floors")
    run([("all fp64 (out fp64)", config("fp64", op="fp64", acc="fp64", out="fp64")),
         ("all fp32 (out fp64)", config("fp32", op="fp32", acc="fp32", out="fp64")),
         ("floor: all fp32, out bf16", config("fp32", op="fp32", acc="fp32")),
         ("floor: recs fp32, fixed bf16 operands, out bf16", config("fp32", op="bf16"))], cases)

    print("# --- (1)-(4): records varied; fixed bf16 operands (L/MQK factors, b*k*exp(G), b*v)")
    cfgs = [("(1) all bf16", config("bf16")),
            ("(2) S=hilo", config("bf16", S="hilo")),
            ("(3) S=hilo VN=hilo", config("bf16", S="hilo", VN="hilo"))]
    for kn in ("QT", "KD", "MQK", "TINV", "W", "U", "VN", "S"):
        cfgs.append((f"(4) {kn}=fp32", config("bf16", **{kn: "fp32"})))
    run(cfgs, cases)

    print("# --- (4b) share of each fixed bf16 operand: records fp32, only that operand bf16")
    run([(f"(4b) only {op}=bf16", config("fp32", op="fp32", **{op: "bf16"}))
         for op in ("FOFF", "FDIAG", "BK", "BV")], cases)

    print("# --- (5) all records fp16 (ranges: max abs of each stored quantity / operand)")
    ranges = {}
    run([("(5) all recs fp16, bf16 operands", config("fp16"))], cases, ranges)
    print("#   max abs: " + "  ".join(f"{k}={v:.3g}" for k, v in ranges.items()))
    print("#   (fp16 max 65504: diag-block factors with midpoint ref reach e^35 -> fp16 overflows there)")
    run([("(5b) all recs fp16, operands fp16 (diag bf16)", config("fp16", op="fp16", FDIAG="bf16")),
         ("(5c) all recs fp16, operands fp16 incl. diag", config("fp16", op="fp16")),
         ("(5d) all recs fp16, operands fp16, diag tf32", config("fp16", op="fp16", FDIAG="tf32"))], cases)

    print("# --- (6) MMA-type-consistent candidates (pairs: Tinv.bk, Tinv.bv | W.S, QT.S | MQK.Vn, Vn.KD)")
    rec = config("bf16", FDIAG="tf32", TINV="fp16", BK="fp16", BV="fp16", U="fp16",
                 MQK="fp16", VN="fp16", KD="fp16")
    cand = [
        ("R: recommended (see header)", rec),
        ("R with diag factors bf16", dict(rec, FDIAG="bf16")),
        ("R with diag factors hilo (3 MMAs)", dict(rec, FDIAG="hilo")),
        ("R with diag factors fp32 (CUDA cores)", dict(rec, FDIAG="fp32")),
        ("R with {Tinv,bk,bv} bf16", dict(rec, TINV="bf16", BK="bf16", BV="bf16")),
        ("R with U bf16", dict(rec, U="bf16")),
        ("R with U fp32", dict(rec, U="fp32")),
        ("R with {MQK,VN,KD} bf16", dict(rec, MQK="bf16", VN="bf16", KD="bf16")),
        ("R with VN=hilo, MQK,KD bf16", dict(rec, MQK="bf16", VN="hilo", KD="bf16")),
        ("R with KD bf16", dict(rec, KD="bf16")),
        ("R with MQK bf16", dict(rec, MQK="bf16")),
        ("R with S=hilo", dict(rec, S="hilo")),
        ("R with b folded into Tinv (v exact)", dict(rec, FOLD=True)),
        ("R with {QT,W,S} fp16 (everything fp16)", dict(rec, QT="fp16", W="fp16", S="fp16")),
    ]
    run(cand, cases)

    print("# --- (7) off-diagonal factors: the kernel since 2675e7c (fp16 when q, k are normalised, as here),")
    print("#     and the shared-factor scheme of docs/design.md (A per row block, B per column block, gap)")
    kern = dict(rec, FOFF="fp16")
    run([("K: kernel (R, off-diagonal factors fp16)", kern),
         ("K with shared factors (fp16)", dict(kern, FSHARE=True)),
         ("R with shared factors (bf16)", dict(rec, FSHARE=True))], cases)

    print("# --- (8) W and U formed in the walk instead of chunk_prepare (records kt and Tb; v read by the")
    print("#     walk): X = v - kt S^T, Vn = Tb X.  fp16s = fp16 with a power-of-two shift (tf32 mantissa)")
    run([("K: kernel", kern),
         ("K, W/U in walk: kt fp16, X fp16s", dict(kern, WUWALK=True, KTOP="fp16", XOP="fp16s")),
         ("K, W/U in walk: kt bf16, X fp16s", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16s")),
         ("K, W/U in walk: kt fp16, X bf16", dict(kern, WUWALK=True, KTOP="fp16", XOP="bf16")),
         ("K, W/U in walk: kt fp16, X fp32", dict(kern, WUWALK=True, KTOP="fp16", XOP="fp32")),
         ("K, W/U in walk: kt fp16, X fp16s, S hilo", dict(kern, WUWALK=True, XOP="fp16s", S="hilo")),
         ("K, U in walk (Tb v + W S^T), W record", dict(kern, UWALK=True))],
        cases)

    print("# --- (9) the producer-warpgroup walk (experiments/walk-producer*.patch): kt bf16 and Tb fp16")
    print("#     records as walk-wu's, W = Tb kt formed in fp32 and rounded to WTOP, U = Tb v kept fp32")
    run([("K, W/U in walk: kt bf16, X fp16s (walk-wu, main)", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16s")),
         ("K, producer walk: kt bf16, W bf16, U fp32", dict(kern, PWALK=True, KTOP="bf16", WTOP="bf16")),
         ("K, producer walk: kt bf16, W fp32 (bound)", dict(kern, PWALK=True, KTOP="bf16", WTOP="fp32"))],
        cases)

    print("# --- (10) XT's fp16 operand with fp16's range: shift from XT's maximum (main) or from a bound")
    print("#      formed before XT exists (experiments/walk-xt-bound.patch); fp16s has no range limits")
    run([("K, W/U in walk: X fp16s (no range)", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16s")),
         ("K, W/U in walk: X fp16, max shift", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16m")),
         ("K, W/U in walk: X fp16, bound shift", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16b")),
         ("K, walk: X max shift, VnT max shift (main before walk-lean)",
          dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16m", VNOP="fp16m")),
         ("K, walk: X max shift, VnT static 8 (main, walk-lean)",
          dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16m", VNOP="fp16st")),
         ("K, walk: X bound shift, VnT max shift", dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16b", VNOP="fp16m")),
         ("K, walk: X bound shift, VnT static 8 (vnt-static)",
          dict(kern, WUWALK=True, KTOP="bf16", XOP="fp16b", VNOP="fp16st"))],
        cases)

    if "--quick" not in sys.argv:
        print("# --- long case: one sequence of 4096 tokens, H=2 (seed 0)")
        inp = make_inputs([4096], 2, 0)
        t1 = time.time()
        long_case = [(inp, reference(inp))]
        print(f"# reference done in {time.time() - t1:.1f}s")
        run([("(1) all bf16", config("bf16")),
             ("(3) S=hilo VN=hilo", config("bf16", S="hilo", VN="hilo"))] + cand[:2], long_case)
    print(f"# total {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
