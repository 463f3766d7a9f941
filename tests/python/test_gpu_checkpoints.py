"""CUDA prefill checkpoint states (kda_spec.md section 5) and the token_rows map of the prefill, on the
sm90 kernels, against the float64 reference.

Each checkpoint must equal the final state of running that prefix alone: it is compared with the
float64 reference run on the prefix, and with our own CUDA prefill run on the prefix.  Skipped unless
a compute capability 9.0 GPU is present.
"""

import os

import pytest
import torch

import flashkda
from flashkda import reference as R
from kda_helpers import BF16, make_inputs, op_kwargs, rel_err, strided_copy


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (sm_90a kernels)")]

DEV = "cuda"
STATE_TOL = 3e-3


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


def _prefix(inp, n, off):
    cu = inp["cu_seqlens"].tolist()
    return {name: inp[name][:, cu[n]:cu[n] + off] for name in ("q", "k", "v", "g", "beta")}


def _gate(inp):
    return {k: inp[k] for k in ("gate_mode", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm",
                                "use_beta_sigmoid")}


def _run_with_checkpoints(inp, offsets, **extra):
    N, J = offsets.shape
    H, D = inp["H"], inp["D"]
    ckpt = torch.full((N, J, H, D, D), float("nan"), device=DEV)
    out = torch.full(inp["v"].shape, float("nan"), dtype=BF16, device=DEV)
    fs = extra.pop("final_state", None)
    if fs is None:
        fs = torch.full((N, H, D, D), float("nan"), device=DEV)
    ws = flashkda.new_workspace(inp["q"], inp["cu_seqlens"])
    kw = op_kwargs(inp)
    kw.update(extra)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, ws, final_state=fs,
                     checkpoint_offsets=offsets, checkpoint_state=ckpt, **kw)
    torch.cuda.synchronize()
    return out, fs, ckpt, ws


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_checkpoints_equal_the_prefix_alone(gen, D, offset_dtype):
    # offsets: 0, mid-chunk, chunk-aligned (64, 128), the length (aligned or not), repeated values
    lens = [200, 0, 128, 1, 65, 1000]
    offsets = torch.tensor([[0, 37, 64, 200], [0, 0, 0, 0], [64, 64, 100, 128], [0, 1, 1, 1],
                            [1, 63, 64, 65], [129, 500, 999, 1000]], dtype=offset_dtype, device=DEV)
    inp = make_inputs(lens, H=4, D=D, device=DEV, generator=gen)
    out, fs, ckpt, ws = _run_with_checkpoints(inp, offsets)
    assert flashkda.read_device_error(ws) == 0
    assert torch.isfinite(ckpt).all(), "a checkpoint was not written"
    h0 = inp["initial_state"]
    for n in range(len(lens)):
        for j in range(offsets.shape[1]):
            off = int(offsets[n, j])
            sub = _prefix(inp, n, off)
            _, ref = R.prefill(**sub, **_gate(inp), initial_state=h0[n:n + 1])
            e = rel_err(ckpt[n, j], ref[0])
            assert e <= STATE_TOL, f"seed {gen.initial_seed()}: checkpoint ({n}, {j}) offset {off}: rel {e:.3e}"
            mine = torch.empty(1, inp["H"], D, D, device=DEV)
            flashkda.prefill(**sub, **_gate(inp), out=torch.empty_like(sub["v"]), initial_state=h0[n:n + 1],
                             final_state=mine)
            assert rel_err(ckpt[n, j], mine[0]) <= STATE_TOL
    # checkpoints change nothing else: same out and final state as a call without them (bit for bit)
    out2 = torch.empty_like(out)
    fs2 = torch.empty_like(fs)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out2, final_state=fs2, **op_kwargs(inp))
    assert torch.equal(out, out2) and torch.equal(fs, fs2)


@pytest.mark.parametrize("g_dtype", [BF16, torch.float32], ids=["g_bf16", "g_fp32"])
def test_checkpoints_of_unaligned_rows_match_aligned(gen, g_dtype):
    """checkpoint_advance copies 16-byte-aligned token rows by cp.async and loads other rows per element,
    a token at a time: the same arithmetic, so the checkpoints are bitwise equal, and both equal the
    prefix alone.  Offsets 1 to 63 tokens past a chunk start (63: every warp preprocesses its most)."""
    lens = [130, 63, 200]
    offsets = torch.tensor([[63, 100], [1, 63], [137, 191]], dtype=torch.int32, device=DEV)
    inp = make_inputs(lens, H=4, D=128, device=DEV, generator=gen, g_dtype=g_dtype)
    _, _, ckpt, ws = _run_with_checkpoints(inp, offsets)
    assert flashkda.read_device_error(ws) == 0
    odd = dict(inp)
    for name in ("q", "k", "v", "g"):
        odd[name] = strided_copy(inp[name], pad=24, offset=1)  # 2-byte offset (4 for fp32 g)
        assert odd[name].data_ptr() % 16 != 0
    _, _, ckpt_odd, ws_odd = _run_with_checkpoints(odd, offsets)
    assert flashkda.read_device_error(ws_odd) == 0
    assert torch.equal(ckpt, ckpt_odd), f"seed {gen.initial_seed()}: the unaligned rows' checkpoints differ"
    h0 = inp["initial_state"]
    for n in range(len(lens)):
        for j in range(offsets.shape[1]):
            off = int(offsets[n, j])
            _, ref = R.prefill(**_prefix(inp, n, off), **_gate(inp), initial_state=h0[n:n + 1])
            e = rel_err(ckpt[n, j], ref[0])
            assert e <= STATE_TOL, f"seed {gen.initial_seed()}: checkpoint ({n}, {j}) offset {off}: rel {e:.3e}"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_with_state_pool(gen, state_dtype):
    lens = [70, 30, 130]
    inp = make_inputs(lens, H=2, D=128, device=DEV, with_initial_state=False, generator=gen)
    pool = (0.1 * torch.randn(5, 2, 128, 128, generator=gen)).to(device=DEV, dtype=state_dtype)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)
    has = torch.tensor([True, True, False], device=DEV)
    offsets = torch.tensor([[0, 50, 70], [1, 2, 3], [0, 129, 130]], device=DEV)
    kw = dict(initial_state=pool, final_state=pool, state_indices=idx, has_initial_state=has)
    _, _, ckpt, ws = _run_with_checkpoints(dict(inp, initial_state=pool), offsets, **kw)
    assert flashkda.read_device_error(ws) == 0
    assert torch.equal(ckpt[0, 0], before[3].float())  # offset 0: the starting state, exactly
    assert torch.isnan(ckpt[1]).all()  # padded sequence: untouched
    assert torch.count_nonzero(ckpt[2, 0]) == 0  # has_initial_state False: zeros
    _, ref = R.prefill(**_prefix(inp, 0, 50), **_gate(inp), initial_state=before[3:4].float())
    assert rel_err(ckpt[0, 1], ref[0]) <= STATE_TOL
    _, ref = R.prefill(**_prefix(inp, 2, 129), **_gate(inp))
    assert rel_err(ckpt[2, 1], ref[0]) <= STATE_TOL
    _, ref = R.prefill(**_prefix(inp, 2, 130), **_gate(inp))
    assert rel_err(ckpt[2, 2], ref[0]) <= STATE_TOL
    tol = STATE_TOL if state_dtype == torch.float32 else 1e-2
    assert rel_err(pool[0].float(), ckpt[2, 2]) <= tol  # the last offset is the final state


def test_bad_checkpoint_offsets_write_nothing(gen):
    inp = make_inputs([10, 20], H=2, D=128, device=DEV, generator=gen)
    for bad in ([[0, 11], [0, 5]], [[4, 3], [0, 5]], [[-1, 3], [0, 5]]):
        offsets = torch.tensor(bad, dtype=torch.int32, device=DEV)
        out, fs, ckpt, ws = _run_with_checkpoints(inp, offsets)
        assert flashkda.read_device_error(ws) == 4, bad
        assert torch.isnan(out.float()).all() and torch.isnan(fs).all() and torch.isnan(ckpt).all()


def test_misaligned_checkpoint_state_is_an_argument_error(gen):
    """The walk stores checkpoint states in 8-byte and checkpoint_advance in 16-byte pieces: a
    contiguous fp32 checkpoint_state 4 bytes off a 16-byte boundary is refused by validation (it
    faulted in the walk, after out and the final states were written)."""
    inp = make_inputs([100], H=2, D=128, device=DEV, generator=gen)
    offsets = torch.tensor([[10, 64]], dtype=torch.int32, device=DEV)
    ckpt = torch.full((2 * 2 * 128 * 128 + 1,), float("nan"), device=DEV)[1:].view(1, 2, 2, 128, 128)
    out = torch.full(inp["v"].shape, float("nan"), dtype=BF16, device=DEV)
    fs = torch.full((1, 2, 128, 128), float("nan"), device=DEV)
    with pytest.raises(ValueError, match=r"argument 'checkpoint_state': expected a 16-byte aligned data pointer"):
        flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, final_state=fs,
                         checkpoint_offsets=offsets, checkpoint_state=ckpt, **op_kwargs(inp))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(fs).all() and torch.isnan(ckpt).all()


def test_too_many_checkpoint_blocks_is_an_argument_error(gen):
    """checkpoint_advance runs N x n_ckpt x H x (V / 64) blocks on one grid dimension (the checkpoint's
    index slowest); validation refuses N x n_ckpt x H x V >= 2^31 before any kernel writes.  Here
    1 x 2^18 x 64 x 128 = 2^31 (the offsets fit in 1 MB; the check precedes checkpoint_state's shape)."""
    inp = make_inputs([100], H=64, D=128, device=DEV, generator=gen)
    offsets = torch.full((1, 1 << 18), 64, dtype=torch.int32, device=DEV)
    ckpt = torch.full((1, 1, 64, 128, 128), float("nan"), device=DEV)
    out = torch.full(inp["v"].shape, float("nan"), dtype=BF16, device=DEV)
    fs = torch.full((1, 64, 128, 128), float("nan"), device=DEV)
    with pytest.raises(ValueError, match=r"argument 'checkpoint_offsets': expected N x n_ckpt x H x V below 2\^31 "
                                         r"on CUDA, got 1 x 262144 x 64 x 128"):
        flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, final_state=fs,
                         checkpoint_offsets=offsets, checkpoint_state=ckpt, **op_kwargs(inp))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(fs).all() and torch.isnan(ckpt).all()


def test_checkpoints_graph_replay(gen):
    inp = make_inputs([300, 17], H=4, D=128, device=DEV, generator=gen)
    offsets = torch.tensor([[100, 300], [5, 17]], device=DEV)
    N, H, D = 2, 4, 128
    ckpt = torch.empty(N, 2, H, D, D, device=DEV)
    out = torch.empty(inp["v"].shape, dtype=BF16, device=DEV)
    fs = torch.empty(N, H, D, D, device=DEV)
    ws = flashkda.new_workspace(inp["q"], inp["cu_seqlens"])
    kw = op_kwargs(inp)

    def call():
        flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, ws, final_state=fs,
                         checkpoint_offsets=offsets, checkpoint_state=ckpt, **kw)

    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    fresh = make_inputs([300, 17], H=4, D=128, device=DEV, generator=gen)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        inp[name].copy_(fresh[name])
    g.replay()
    torch.cuda.synchronize()
    eager = torch.empty_like(ckpt)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], torch.empty_like(out), ws,
                     final_state=torch.empty_like(fs), checkpoint_offsets=offsets, checkpoint_state=eager, **kw)
    torch.cuda.synchronize()
    assert torch.equal(ckpt, eager)


@pytest.mark.parametrize("g_dtype", [BF16, torch.float32], ids=["g_bf16", "g_fp32"])
def test_prefill_token_rows(gen, g_dtype):
    """Logical tokens at scattered rows of a larger step: outputs land at those rows only.  Both g
    element types: chunk_prepare stages the rows of a row map through one path per type."""
    lens = [70, 0, 33]
    T = sum(lens)
    R_rows = T + 29
    inp = make_inputs(lens, H=4, D=128, device=DEV, generator=gen, g_dtype=g_dtype)
    rows = torch.randperm(R_rows, generator=gen)[:T].to(DEV)
    big = {}
    for name in ("q", "k", "v", "g", "beta"):
        x = inp[name]
        b = torch.randn((1, R_rows) + tuple(x.shape[2:]), generator=gen).to(device=DEV, dtype=x.dtype)
        b[:, rows] = x
        big[name] = b
    out = torch.full(big["v"].shape, float("nan"), dtype=BF16, device=DEV)
    fs = torch.empty(len(lens), 4, 128, 128, device=DEV)
    ws = flashkda.new_workspace(inp["q"], inp["cu_seqlens"])
    flashkda.prefill(big["q"], big["k"], big["v"], big["g"], big["beta"], out, ws, final_state=fs,
                     token_rows=rows.to(torch.int32), **op_kwargs(inp))
    torch.cuda.synchronize()
    assert flashkda.read_device_error(ws) == 0
    ref_out = torch.empty(inp["v"].shape, dtype=BF16, device=DEV)
    ref_fs = torch.empty_like(fs)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], ref_out, final_state=ref_fs,
                     **op_kwargs(inp))
    assert torch.equal(out[:, rows], ref_out) and torch.equal(fs, ref_fs)
    untouched = torch.ones(R_rows, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.isnan(out[:, untouched].float()).all()
    # a row outside [0, rows) is caught on the device, and nothing is written
    bad = rows.clone()
    bad[5] = R_rows
    out.fill_(float("nan"))
    flashkda.prefill(big["q"], big["k"], big["v"], big["g"], big["beta"], out, ws, final_state=fs,
                     token_rows=bad, **op_kwargs(inp))
    assert flashkda.read_device_error(ws) == 3
    assert torch.isnan(out.float()).all()
