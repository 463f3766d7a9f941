"""CPU tests of the chunk-record model (record_oracle.py) that the GPU record tests compare chunk_prepare
against: the SW128 image reader, and that chaining the walk's products over the model's tiles is the
token recurrence of the float64 reference (so the model specifies the record, independently of the
kernel)."""

import pytest
import torch

from flashkda import reference as R  # noqa: F401  (the recurrence the model is checked against)
from kda_helpers import make_inputs
import record_oracle as O


@pytest.mark.parametrize("rows,cols", [(64, 128), (128, 64), (64, 64)])
def test_sw128_image_round_trip(rows, cols):
    m = torch.arange(rows * cols, dtype=torch.int32).to(torch.int16).view(rows, cols)
    image = O.swizzle(m)
    assert torch.equal(O.unswizzle(image, rows, cols), m)
    # every element lands once: the image is a permutation of the matrix
    assert torch.equal(torch.sort(image.int()).values, torch.sort(m.reshape(-1).int()).values)


def test_sw128_offsets_by_hand():
    # kda_sw128.h: piece p of row r at r * 128 + ((p ^ (r & 7)) * 16) bytes; the next 64 columns R * 128
    # bytes on.  In 16-bit elements: (1, 0) -> 64 + 8, (3, 9) -> 3 * 64 + (1 ^ 3) * 8 + 1, (0, 64) -> 64 rows * 64.
    el = lambda rows, r, c: int(O.sw128_element(rows, torch.tensor(r), torch.tensor(c)))  # noqa: E731
    assert el(64, 1, 0) == 72
    assert el(64, 3, 9) == 3 * 64 + 2 * 8 + 1
    assert el(64, 0, 64) == 64 * 64
    assert el(128, 9, 70) == 128 * 64 + 9 * 64 + ((0 ^ 1) * 8) + 6


def test_record_layout_matches_chunk_record():
    # ChunkRecord<128>: 3 x 16 KB (KT, QT, KD) + 2 x 5120 (TB, MQK packed) + 512 (gamma) + 128 = 60,032 bytes.
    assert O.record_layout(128)["bytes"] == 60032
    assert O.record_layout(64)["bytes"] % 128 == 0


def test_triangle_image_round_trip():
    m = (torch.arange(64 * 64, dtype=torch.int32) % 30000 + 1).to(torch.int16).view(64, 64)
    r = torch.arange(64).view(64, 1)
    c = torch.arange(64).view(1, 64)
    m = torch.where(c // 16 <= r // 16, m, torch.zeros_like(m))  # zero blocks above the diagonal
    image = O.pack_triangle(m)
    assert image.numel() * 2 == O.TRI_BYTES
    assert torch.equal(O.unpack_triangle(image), m)
    # every kept element lands once: the image is a permutation of the 10 lower blocks
    assert torch.equal(torch.sort(image.int()).values, torch.sort(m[m != 0].int()).values)


def test_triangle_offsets_by_hand():
    # kda_sw128.h, tri64_offset: step ks's tail starts at 0, 2048, 3584, 4608 bytes and begins at row 16 ks;
    # row group +1 is 256 bytes, column piece +1 128, row + 1 16, column + 1 2.
    el = lambda r, c: int(O.tri64_element(torch.tensor(r), torch.tensor(c)))  # noqa: E731
    assert el(0, 0) == 0
    assert el(1, 9) == (16 + 128 + 2) // 2
    assert el(16, 16) == 2048 // 2
    assert el(63, 63) == (4608 + 256 + 128 + 7 * 16 + 7 * 2) // 2
    assert el(32, 40) == (3584 + 128) // 2
    assert el(63, 47) == O.TRI_BYTES // 2 - 1 - 512 // 2


@pytest.mark.parametrize("gate_mode,l2", [("bounded", True), ("softplus", False), ("precomputed", True)])
def test_walk_over_model_tiles_is_the_recurrence(gate_mode, l2):
    gen = torch.Generator().manual_seed(2100)
    lens = [100, 17, 64, 131, 0]
    inp = make_inputs(lens, H=2, D=64, gate_mode=gate_mode, use_qk_l2norm=l2, generator=gen)
    scale = 0.3
    ref_out, ref_final = R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=scale,
                                   gate_mode=gate_mode, A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                   lower_bound=inp["lower_bound"], use_qk_l2norm=l2,
                                   use_beta_sigmoid=inp["use_beta_sigmoid"], initial_state=inp["initial_state"],
                                   cu_seqlens=inp["cu_seqlens"])
    q, k, v, a, b = O.preprocessed(inp)
    cu = inp["cu_seqlens"].tolist()
    out = torch.zeros_like(ref_out.reshape(-1, 2, 64))
    for n in range(len(lens)):
        for h in range(2):
            S = inp["initial_state"][n, h].double()
            for c0 in range(cu[n], cu[n + 1], O.C):
                c1 = min(c0 + O.C, cu[n + 1])
                tiles = O.oracle_tiles(q[c0:c1, h], k[c0:c1, h], v[c0:c1, h], a[c0:c1, h], b[c0:c1, h], scale)
                o, S = O.chunk_walk(S, tiles)
                out[c0:c1, h] = o[: c1 - c0]
                # inert padding: nothing of the rows past the end reaches a tile
                pad = slice(c1 - c0, O.C)
                for name in ("KT", "QT", "KD", "MQK"):
                    assert torch.count_nonzero(tiles[name][pad]) == 0, name
                assert torch.count_nonzero(tiles["TB"][:, pad]) == 0  # v's padding rows meet zero columns
            assert R.rel_err(S, ref_final[n, h]) <= 1e-10, (n, h)
    assert R.rel_err(out.reshape(ref_out.shape), ref_out) <= 1e-10


def test_unshifted_undoes_the_power_of_two_shifts():
    rec = {name: torch.ones(2, 2, dtype=torch.float64) for name in O.TILES}
    rec.update(gamma=torch.ones(2, dtype=torch.float64), shift_t=3, shift_m=-2, shift_d=1)
    u = O.unshifted(rec)
    assert float(u["TB"][0, 0]) == 8.0 and float(u["MQK"][0, 0]) == 0.25 and float(u["KD"][0, 0]) == 2.0
    assert float(u["KT"][0, 0]) == 1.0 and float(u["QT"][0, 0]) == 1.0


@pytest.mark.parametrize("varlen", [True, False])
def test_compare_records_reads_what_a_prepare_wrote(varlen):
    """The GPU test's reader on a workspace written by the model itself (write_record: shifts, 16-bit
    rounding, SW128 images, slots): errors at storage precision; one corrupted tile is named with its
    (sequence, chunk, head)."""
    gen = torch.Generator().manual_seed(2200)
    inp = (make_inputs([100, 17, 64, 131], H=2, D=64, generator=gen) if varlen
           else make_inputs(B=2, T=90, H=2, D=64, generator=gen))
    B, T, H, D = inp["q"].shape
    slots = (T // O.C + len(inp["cu_seqlens"])) if varlen else B * ((T + O.C - 1) // O.C)
    ws = torch.zeros(O.HEADER_BYTES + slots * H * O.record_layout(D)["bytes"], dtype=torch.uint8)
    q, k, v, a, b = O.preprocessed(inp)
    for n, c, t0, t1, slot in O.chunks(inp):
        for h in range(H):
            tiles = O.oracle_tiles(q[t0:t1, h], k[t0:t1, h], v[t0:t1, h], a[t0:t1, h], b[t0:t1, h], 0.25)
            O.write_record(ws, slot, h, H, D, tiles, (3 + h, -2, n % 2))
    worst = O.compare_records(ws, inp, 0.25)
    assert set(worst) == set(O.TILES + ("gamma",))
    for name, (err, _) in worst.items():
        assert err <= (4e-3 if name in ("KT", "QT") else 1e-3 if name != "gamma" else 1e-7), (name, err)
    # corrupt the KD tile of the last chunk of sequence 1, head 1: named as such
    n, c, t0, t1, slot = [x for x in O.chunks(inp) if x[0] == 1][-1]
    lay = O.record_layout(D)
    at = O.HEADER_BYTES + (slot * H + 1) * lay["bytes"] + lay["KD"]
    ws[at: at + 256] = 0x3c  # fp16 ~1.06 over a row of the tile
    worst = O.compare_records(ws, inp, 0.25)
    assert worst["KD"][0] > 0.1 and worst["KD"][1] == (1, c, 1), worst["KD"]


def test_mqk_error_is_judged_against_its_magnitude_bound():
    """A chunk of one token has a single MQK entry, scale q . k, which for nearly orthogonal q and k is
    far below scale |q| |k|, the magnitude the kernel's rounding is relative to: an error of 4e-5
    |q| |k| (what fp16 q / k and tf32 products give) is huge against the entry and small against the
    bound, while a wrong entry is off by O(1) against either."""
    D = 64
    q = torch.zeros(1, D, dtype=torch.float64)
    k = torch.zeros(1, D, dtype=torch.float64)
    q[0, 0], k[0, 1], k[0, 0] = 1.0, 1.0, 1e-6
    t = O.oracle_tiles(q, k, torch.zeros(1, D), torch.zeros(1, D), torch.ones(1), 0.5)
    bound = float(t["MQK_bound"][0, 0])
    assert abs(bound - 0.5 * float(q.norm() * k.norm())) < 1e-12
    assert float(t["MQK_bound"][1:].abs().sum()) == 0.0  # inert rows
    rounded = t["MQK"].clone()
    rounded[0, 0] += 4e-5 * bound
    assert O.rel_frobenius(rounded, t["MQK"]) > 1.0
    assert O.rel_frobenius(rounded, t["MQK"], t["MQK_bound"]) < 1e-4
    wrong = t["MQK"].clone()
    wrong[0, 0] = bound
    assert O.rel_frobenius(wrong, t["MQK"], t["MQK_bound"]) > 0.5
