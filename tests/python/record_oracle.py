"""A float64 model of chunk_prepare's chunk records, and a reader of the records a CUDA prefill left in
its workspace, so that a test can tell which tile of which (chunk, head) a prepare kernel got wrong
(the end-to-end tests only see the output and the final state).

The record of one (chunk, head) (ChunkRecord<D> in csrc/sm90/kda_common.cuh, D = K = V, C = 64):

    KT  [C, D] bf16   kt = k 2^G                      (kb = k 2^-G below)
    QT  [C, D] bf16   scale q 2^G
    KD  [C, D] fp16   k 2^(G_last - G) * 2^-shift_d
    TB  [C, C] fp16   T_inv diag(b) * 2^-shift_t                  (packed triangle, 5120 bytes)
    MQK [C, C] fp16   scale lower_incl(q 2^G kb^T) * 2^-shift_m  (packed triangle, 5120 bytes)
    gamma [D] fp32    2^G_last
    shifts int32      shift_t, shift_m, shift_d (then padding to 128 bytes)

with G the within-chunk cumulative log decay in log2 units (G_t = sum_{s <= t} a_s / ln 2), L =
strict_lower(diag(b) kt kb^T), T_inv = (I + L)^-1, KT / QT / KD stored as their SW128 shared-memory
images and TB / MQK as packed triangles without their zero 16 x 16 blocks above the diagonal
(tri64_offset, csrc/sm90/kda_sw128.h).  Rows past a sequence's end are inert: q = k = v = 0,
a = 0, b = 0.  The record of chunk c of sequence n sits at slot floor(cu[n] / C) + n + c (varlen) or
n ceil(T / C) + c (fixed length), head h: byte 4096 + (slot H + h) * record_bytes(D) of the workspace.

:func:`chunk_walk` applies the walk's products to true (unshifted) tiles and the chunk's v rows
(the walk reads v itself: neither W = TB kt nor U = TB v is ever stored) in float64; the CPU
tests check that chaining it over a sequence's chunks is the token recurrence, which is what makes
the model a specification of the record rather than a second copy of the kernel.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

Tensor = torch.Tensor

C = 64
HEADER_BYTES = 4096
TILES = ("KT", "QT", "KD", "TB", "MQK")
_TILE_DTYPE = {"KT": torch.bfloat16, "QT": torch.bfloat16, "KD": torch.float16, "TB": torch.float16,
               "MQK": torch.float16}


TRI_TILES = ("TB", "MQK")
TRI_BYTES = 5120  # a packed 64 x 64 triangle: its 10 lower 16 x 16 blocks


def record_layout(D: int) -> Dict[str, int]:
    """Byte offsets of the record's parts, and its size ('bytes'), as ChunkRecord<D>."""
    off = {"KT": 0}
    off["QT"] = off["KT"] + C * D * 2
    off["KD"] = off["QT"] + C * D * 2
    off["TB"] = off["KD"] + C * D * 2
    off["MQK"] = off["TB"] + TRI_BYTES
    off["gamma"] = off["MQK"] + TRI_BYTES
    off["shifts"] = off["gamma"] + D * 4
    off["bytes"] = off["shifts"] + 128
    return off


def tile_shape(name: str, D: int) -> Tuple[int, int]:
    return {"KT": (C, D), "QT": (C, D), "KD": (C, D), "TB": (C, C), "MQK": (C, C)}[name]


def sw128_element(rows: int, r: Tensor, col: Tensor) -> Tensor:
    """Element offset (16-bit units) of (r, col) in a SW128 tile of `rows` rows: 64-column halves of
    rows x 128 bytes; inside a half, the 16-byte piece p of row r at r * 128 + ((p ^ (r & 7)) * 16)."""
    half, piece, within = col // 64, (col % 64) // 8, col % 8
    return half * (rows * 64) + r * 64 + ((piece ^ (r % 8)) * 8) + within


def unswizzle(image: Tensor, rows: int, cols: int) -> Tensor:
    """The [rows, cols] matrix of a SW128 image given as a flat tensor of 16-bit elements."""
    r = torch.arange(rows).view(rows, 1).expand(rows, cols)
    c = torch.arange(cols).view(1, cols).expand(rows, cols)
    return image[sw128_element(rows, r, c).to(image.device)]


def swizzle(matrix: Tensor) -> Tensor:
    """The SW128 image (flat) of a [rows, cols] matrix of a 16-bit dtype (the inverse of unswizzle)."""
    rows, cols = matrix.shape
    r = torch.arange(rows).view(rows, 1).expand(rows, cols)
    c = torch.arange(cols).view(1, cols).expand(rows, cols)
    image = torch.empty(rows * cols, dtype=matrix.dtype, device=matrix.device)
    image[sw128_element(rows, r, c).to(matrix.device).reshape(-1)] = matrix.reshape(-1)
    return image


def tri64_element(r: Tensor, col: Tensor) -> Tensor:
    """Element offset (16-bit units) of (r, col), col // 16 <= r // 16, in a packed triangle (kda_sw128.h,
    tri64_offset): K step ks = col // 16 holds rows 16 ks .. 63 as core matrices of 8 rows x 16 bytes, row
    group g = r // 8 at (g - 2 ks) * 256 bytes, column piece (col // 8) % 2 at 128, row r % 8 at 16; the
    steps' tails follow each other (2048, 1536, 1024, 512 bytes)."""
    ks = col // 16
    step_start = 2048 * ks - 256 * ks * (ks - 1)
    byte = step_start + (r // 8 - 2 * ks) * 256 + ((col // 8) % 2) * 128 + (r % 8) * 16 + (col % 8) * 2
    return byte // 2


def _tri_index():
    r = torch.arange(C).view(C, 1).expand(C, C)
    c = torch.arange(C).view(1, C).expand(C, C)
    keep = (c // 16) <= (r // 16)
    return r[keep], c[keep]


def pack_triangle(matrix: Tensor) -> Tensor:
    """The packed image (flat, TRI_BYTES / 2 elements) of a 64 x 64 matrix of a 16-bit dtype: its blocks
    above the diagonal are dropped (they must be zero for the walk, which reads zeros there)."""
    r, c = _tri_index()
    image = torch.empty(TRI_BYTES // 2, dtype=matrix.dtype, device=matrix.device)
    image[tri64_element(r, c).to(matrix.device)] = matrix[r.to(matrix.device), c.to(matrix.device)]
    return image


def unpack_triangle(image: Tensor) -> Tensor:
    """The 64 x 64 matrix of a packed image (zeros above the diagonal blocks)."""
    r, c = _tri_index()
    m = torch.zeros(C, C, dtype=image.dtype, device=image.device)
    m[r.to(image.device), c.to(image.device)] = image[tri64_element(r, c).to(image.device)]
    return m


def chunk_slot(n: int, c: int, cu: List[int] = None, T: int = 0) -> int:
    """The record slot of chunk c of sequence n (cu: the cu_seqlens values, or None for fixed length T)."""
    if cu is not None:
        return cu[n] // C + n + c
    return n * ((T + C - 1) // C) + c


def read_record(workspace: Tensor, slot: int, h: int, H: int, D: int) -> Dict:
    """One record from a workspace (uint8, any device) as float64 CPU tensors (tiles as stored, i.e.
    still shifted) plus the int shifts 'shift_t', 'shift_m', 'shift_d'."""
    lay = record_layout(D)
    base = HEADER_BYTES + (slot * H + h) * lay["bytes"]
    raw = workspace[base: base + lay["bytes"]].cpu()
    rec = {}
    for name in TILES:
        rows, cols = tile_shape(name, D)
        start = lay[name]
        if name in TRI_TILES:
            rec[name] = unpack_triangle(raw[start: start + TRI_BYTES].view(_TILE_DTYPE[name])).double()
            continue
        image = raw[start: start + rows * cols * 2].view(_TILE_DTYPE[name])
        rec[name] = unswizzle(image, rows, cols).double()
    rec["gamma"] = raw[lay["gamma"]: lay["gamma"] + D * 4].view(torch.float32).double()
    shifts = raw[lay["shifts"]: lay["shifts"] + 12].view(torch.int32).tolist()
    rec["shift_t"], rec["shift_m"], rec["shift_d"] = shifts
    return rec


def unshifted(rec: Dict) -> Dict:
    """The true tiles of a record read by read_record (its power-of-two shifts undone)."""
    out = dict(rec)
    out["KD"] = rec["KD"] * 2.0 ** rec["shift_d"]
    out["TB"] = rec["TB"] * 2.0 ** rec["shift_t"]
    out["MQK"] = rec["MQK"] * 2.0 ** rec["shift_m"]
    return out


def oracle_tiles(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float) -> Dict[str, Tensor]:
    """The true record tiles of one (chunk, head) from its preprocessed float64 rows (q, k l2-normalised
    if the call normalises; a the natural-log decay; b the activated beta): q, k, a [rows, D], v
    [rows, D], b [rows], rows <= C.  Rows rows .. C-1 are the inert padding.  "V" (the padded v rows)
    is not part of the record: the walk reads it from the input to form U = TB v."""
    rows, D = q.shape
    assert rows <= C

    def pad(x):
        z = torch.zeros((C,) + tuple(x.shape[1:]), dtype=torch.float64)
        z[:rows] = x.double().cpu()
        return z

    q, k, v, a, b = pad(q), pad(k), pad(v), pad(a), pad(b)
    G = torch.cumsum(a, 0) / math.log(2.0)  # log2 units, inclusive
    kt, kb = k * torch.exp2(G), k * torch.exp2(-G)
    lower = torch.tril(torch.ones(C, C, dtype=torch.float64), -1)
    L = lower * (b[:, None] * (kt @ kb.T))
    T_inv = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + L)
    Tb = T_inv * b[None, :]
    return {
        "KT": kt,
        "QT": scale * q * torch.exp2(G),
        "KD": k * torch.exp2(G[-1:] - G),
        "TB": Tb,
        "V": v,
        "MQK": scale * torch.tril((q * torch.exp2(G)) @ kb.T),
        # |MQK_ij| <= scale |q_i 2^G_i| |kb_j|: the magnitude its rounding is relative to (see
        # compare_records)
        "MQK_bound": scale * torch.tril(torch.outer((q * torch.exp2(G)).norm(dim=1), kb.norm(dim=1))),
        "gamma": torch.exp2(G[-1]),
    }


def chunk_walk(S: Tensor, tiles: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
    """The walk's products on one chunk in float64 (state S [V, K], V-first): returns (O [C, V], S_end).

        VnT = (V^T - S KT^T) TB^T,   OT = S QT^T + VnT MQK^T,   S_end = S diag(gamma) + VnT KD
    """
    VnT = (tiles["V"].T - S @ tiles["KT"].T) @ tiles["TB"].T
    OT = S @ tiles["QT"].T + VnT @ tiles["MQK"].T
    return OT.T, S * tiles["gamma"][None, :] + VnT @ tiles["KD"]


def write_record(workspace: Tensor, slot: int, h: int, H: int, D: int, tiles: Dict[str, Tensor],
                 shifts: Tuple[int, int, int]) -> None:
    """Stores true tiles as chunk_prepare would (the inverse of read_record + unshifted): each 16-bit tile
    shifted, rounded to its storage dtype and written as its SW128 image (TB, MQK: packed triangles).  For
    tests of the reader."""
    shift_t, shift_m, shift_d = shifts
    scaled = dict(tiles, TB=tiles["TB"] * 2.0 ** -shift_t, MQK=tiles["MQK"] * 2.0 ** -shift_m,
                  KD=tiles["KD"] * 2.0 ** -shift_d)
    lay = record_layout(D)
    base = HEADER_BYTES + (slot * H + h) * lay["bytes"]
    rec = torch.zeros(lay["bytes"], dtype=torch.uint8)
    for name in TILES:
        m = scaled[name].to(_TILE_DTYPE[name])
        image = pack_triangle(m) if name in TRI_TILES else swizzle(m)
        rec[lay[name]: lay[name] + image.numel() * 2] = image.view(torch.uint8)
    gamma = tiles["gamma"].float()  # fp32, flushed below 2^-126 as the kernel's ex2.approx.ftz
    gamma = torch.where(gamma < 2.0 ** -126, torch.zeros_like(gamma), gamma)
    rec[lay["gamma"]: lay["gamma"] + D * 4] = gamma.view(torch.uint8)
    rec[lay["shifts"]: lay["shifts"] + 12] = torch.tensor([shift_t, shift_m, shift_d], dtype=torch.int32).view(
        torch.uint8)
    workspace[base: base + lay["bytes"]] = rec.to(workspace.device)


def preprocessed(inp: Dict):
    """Spec section 2's per-token preprocessing in float64 on the CPU, tokens flattened (make_inputs'
    dict): q, k (l2-normalised if the call normalises), v, a (natural-log decay) [B*T, H, D], b [B*T, H]."""
    from flashkda import reference as R

    B, T, H, _ = inp["q"].shape
    q, k = inp["q"].double().cpu(), inp["k"].double().cpu()
    if inp["use_qk_l2norm"]:
        q, k = R.l2norm(q), R.l2norm(k)
    a = R.gate_log_decay(inp["g"].cpu(), inp["gate_mode"], inp["A_log"].cpu(), inp["dt_bias"].cpu(),
                         inp["lower_bound"])
    b = R.beta_activation(inp["beta"].cpu(), inp["use_beta_sigmoid"])

    def flat(x):
        return x.reshape(B * T, H, -1)

    return flat(q), flat(k), flat(inp["v"].double().cpu()), flat(a), b.reshape(B * T, H)


def chunks(inp: Dict):
    """(sequence n, chunk c, first token, end token, record slot) of every chunk of a make_inputs dict."""
    B, T = inp["q"].shape[:2]
    if inp["cu_seqlens"] is not None:
        cu = [int(x) for x in inp["cu_seqlens"].tolist()]
        spans = [(cu[n], cu[n + 1] - cu[n]) for n in range(len(cu) - 1)]
    else:
        cu, spans = None, [(n * T, T) for n in range(B)]
    for n, (start, length) in enumerate(spans):
        for c in range((length + C - 1) // C):
            yield n, c, start + c * C, start + min(length, (c + 1) * C), chunk_slot(n, c, cu, T)


def compare_records(workspace: Tensor, inp: Dict, scale: float) -> Dict[str, Tuple[float, Tuple[int, int, int]]]:
    """Every record of a call on `inp` against the model: per tile name, the largest relative
    (Frobenius) error and its (sequence, chunk, head).  A non-finite stored value counts as error inf.

    MQK's error is relative to its magnitude bound scale |q_i 2^G_i| |kb_j| (Frobenius over the lower
    triangle), not to MQK itself: an entry is a dot product whose rounding (fp16 q / k, tf32
    diagonal blocks) is relative to |q| |k|, and a chunk of one token has a single entry, which for
    nearly orthogonal q and k is far smaller than that (a 1-token sequence of the varlen test failed
    ~20% of random seeds at 5e-3 relative to the entry, with errors of 4e-5 |q| |k| or less:
    scripts/records_soak.py, perf-notes v19)."""
    H, D = inp["q"].shape[2], inp["q"].shape[3]
    q, k, v, a, b = preprocessed(inp)
    worst: Dict[str, Tuple[float, Tuple[int, int, int]]] = {}
    for n, c, t0, t1, slot in chunks(inp):
        for h in range(H):
            ref = oracle_tiles(q[t0:t1, h], k[t0:t1, h], v[t0:t1, h], a[t0:t1, h], b[t0:t1, h], scale)
            rec = read_record(workspace, slot, h, H, D)
            got = unshifted(rec)
            # gamma is stored in fp32 from ex2.approx.ftz: channels that decay by more than 2^-126 over
            # the chunk are 0 there (flushed, not denormal)
            g32 = ref["gamma"].float().double()
            ref["gamma"] = torch.where(g32 < 2.0 ** -126, torch.zeros_like(g32), g32)
            for name in TILES + ("gamma",):
                finite = bool(torch.isfinite(rec[name]).all())
                den = ref["MQK_bound"] if name == "MQK" else ref[name]
                err = rel_frobenius(got[name], ref[name], den) if finite else math.inf
                if err > worst.get(name, (-1.0, None))[0]:
                    worst[name] = (err, (n, c, h))
    return worst


def rel_frobenius(x: Tensor, ref: Tensor, scale_ref: Tensor = None) -> float:
    """||x - ref|| / ||scale_ref|| (Frobenius; scale_ref defaults to ref)."""
    den = float(torch.linalg.vector_norm(ref if scale_ref is None else scale_ref))
    num = float(torch.linalg.vector_norm(x - ref))
    return num / den if den > 0 else num
