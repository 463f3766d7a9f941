"""flashkda.decode on CUDA (the sm90 decode kernel) against the float64 reference (kda_spec.md
sections 4 and 6): plain decode, speculative decode with acceptance / padding / rollback slots,
varlen, token_rows, determinism, CUDA graphs, device-side index errors, and a serving simulation
that interleaves CUDA prefill continuations, decode and spec decode on one pool.

Skipped unless a CUDA GPU of compute capability 9.0 is present.  Inputs are fresh random values each
run (the seed is in every failure message); outputs are poisoned with NaN first, so every element
that must be written is written and finite, and every pool row that must not be touched is compared
bitwise with its value before the call.
"""

import inspect
import os
import random

import pytest
import torch

import flashkda
from flashkda import reference as R
from kda_helpers import BF16, make_inputs, rel_err, strided_copy
from pool_simulation import run_pool_simulation


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (sm_90a kernels)")]

DEV = "cuda"
FP32, NAN = torch.float32, float("nan")
SPEC_OUT, SPEC_STATE = 4e-3, 3e-3  # required: bounded gate, fp32 pool
LOOSE_OUT, LOOSE_STATE = 1e-2, 1e-2  # other gate modes, bf16 pool (one bf16 rounding of the state)
GATE_KEYS = ("gate_mode", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm", "use_beta_sigmoid")
# Device-side error codes (flashkda::DeviceError, flashkda.DEVICE_ERRORS)
ERR_STATE_INDEX, ERR_TOKEN_ROW, ERR_ACCEPTED, ERR_SLOT_CONFLICT = 2, 3, 5, 6
# The wrapper selects a backend; these tests are about the sm90 kernel, so ask for it by name
# (never fla's fallback or the float64 reference, whatever FLASHKDA_BACKEND says).
CUDA_BACKEND = {"backend": "cuda"} if "backend" in inspect.signature(flashkda.decode).parameters else {}


@pytest.fixture(autouse=True, params=["auto", "latency", "pipelined"])
def decode_kernel(request, monkeypatch):
    """Every test runs three times: with the kernel the call selects (the fixed-layout kernel for
    small fixed-layout calls, the latency kernel for other small calls; for large ones the stream
    kernels in the fixed layout (plain one-token calls; spec / several-token calls on bf16 pools),
    else the pipelined one), and with the latency and the pipelined kernel forced
    (FLASHKDA_DECODE_KERNEL, a dev switch read on every call; a forced kernel that cannot run a call
    falls through to the next)."""
    if request.param == "auto":
        monkeypatch.delenv("FLASHKDA_DECODE_KERNEL", raising=False)
    else:
        monkeypatch.setenv("FLASHKDA_DECODE_KERNEL", request.param)
    return request.param


@pytest.fixture
def gen():
    """A CPU generator with a fresh seed (failures report it as ``seed <n>``)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


def seed_of(g):
    return g.initial_seed()


def tols(inp, pool):
    spec = inp["gate_mode"] == "bounded" and pool.dtype == FP32
    return (SPEC_OUT, SPEC_STATE) if spec else (LOOSE_OUT, LOOSE_STATE)


def tokens(gen, N=1, T=1, lens=None, H=4, D=128, **kw):
    """Random token inputs on the GPU: fixed [N, T] or varlen (lens)."""
    return make_inputs(lens, B=N, T=T, H=H, D=D, device=DEV, with_initial_state=False, generator=gen, **kw)


def new_pool(gen, P, H, D, dtype=FP32):
    cg = torch.Generator(device=DEV).manual_seed(int(torch.randint(1 << 31, (1,), generator=gen)))
    return (0.1 * torch.randn(P, H, D, D, device=DEV, generator=cg)).to(dtype)


def perm(gen, P):
    return torch.randperm(P, generator=gen)


def workspace():
    return torch.empty(int(torch.ops.flashkda.get_decode_workspace_size()), dtype=torch.uint8, device=DEV)


def gate_kwargs(inp):
    return {key: inp[key] for key in GATE_KEYS}


def run_decode(inp, pool, idx, acc=None, out=None, ws=None, token_rows=None, cu_seqlens="inp"):
    """flashkda.decode on poisoned (NaN) out unless given; returns out."""
    if out is None:
        out = torch.full(inp["v"].shape, NAN, dtype=BF16, device=DEV)
    cu = inp["cu_seqlens"] if isinstance(cu_seqlens, str) else cu_seqlens
    extra = {}
    if token_rows is not None:
        extra["token_rows"] = token_rows
    ret = flashkda.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, out,
                          num_accepted_tokens=acc, cu_seqlens=cu, workspace=ws, **gate_kwargs(inp), **extra,
                          **CUDA_BACKEND)
    assert ret is out
    return out


def ref_decode(inp, pool, idx, acc=None, cu_seqlens="inp"):
    cu = inp["cu_seqlens"] if isinstance(cu_seqlens, str) else cu_seqlens
    return R.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, num_accepted_tokens=acc,
                    cu_seqlens=cu, **gate_kwargs(inp))


def check_pool(gen, pool, before, ref_pool, state_tol, what=""):
    """Rows the reference leaves as they were: bitwise untouched; the others within state_tol
    (rel err over all written rows together).  Returns the written rows."""
    same = (ref_pool == before.double()).flatten(1).all(1)
    kept = same.nonzero().flatten()
    written = (~same).nonzero().flatten()
    if not torch.equal(pool[kept], before[kept]):
        bad = [int(r) for r in kept if not torch.equal(pool[r], before[r])]
        raise AssertionError(f"seed {seed_of(gen)}{what}: pool rows {bad} were written but must be untouched")
    if written.numel():
        assert torch.isfinite(pool[written].float()).all(), f"seed {seed_of(gen)}{what}: written rows not finite"
        e = rel_err(pool[written], ref_pool[written])
        assert e <= state_tol, f"seed {seed_of(gen)}{what}: state rel {e:.3e} > {state_tol}"
    return written


def check_decode(gen, inp, pool, idx, acc=None, out_tol=None, state_tol=None, ws=None, what=""):
    """Runs the op on `pool` (in place) and compares out and every pool row with the reference."""
    before = pool.clone()
    ref_out, ref_pool = ref_decode(inp, before, idx, acc)
    ws = workspace() if ws is None else ws
    out = run_decode(inp, pool, idx, acc, ws=ws)
    torch.cuda.synchronize()
    assert flashkda.read_device_error(ws) == 0, f"seed {seed_of(gen)}{what}: device error on a valid call"
    t_out, t_state = tols(inp, pool)
    out_tol = t_out if out_tol is None else out_tol
    state_tol = t_state if state_tol is None else state_tol
    assert torch.isfinite(out.float()).all(), f"seed {seed_of(gen)}{what}: out has NaN/Inf (unwritten?)"
    e = rel_err(out, ref_out)
    assert e <= out_tol, f"seed {seed_of(gen)}{what}: out rel {e:.3e} > {out_tol}"
    check_pool(gen, pool, before, ref_pool, state_tol, what)
    return out, ref_out, ref_pool, before


def test_workspace_size():
    n = int(torch.ops.flashkda.get_decode_workspace_size())
    assert 4 <= n <= 1 << 20


@pytest.mark.skipif(not hasattr(flashkda, "explain_decode"), reason="no flashkda.explain_decode")
@pytest.mark.parametrize("spec", [False, True], ids=["1d", "2d"])
def test_auto_backend_is_the_kernel(gen, spec, monkeypatch):
    """On an sm90 GPU with a CUDA build, backend "auto" picks the kernel (not fla, not the reference)."""
    monkeypatch.delenv("FLASHKDA_BACKEND", raising=False)
    T = 4 if spec else 1
    inp = tokens(gen, N=2, T=T, H=4, D=128)
    pool = new_pool(gen, 8, 4, 128)
    idx = torch.arange(2 * T, device=DEV).view(2, T) if spec else torch.tensor([3, 5], device=DEV)
    sel = flashkda.explain_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx,
                                  num_accepted_tokens=torch.tensor([1, 4], device=DEV) if spec else None,
                                  backend="auto", **gate_kwargs(inp))
    assert sel.backend == "cuda", str(sel)


def test_device_error_codes_are_documented():
    for code in (ERR_STATE_INDEX, ERR_TOKEN_ROW, ERR_ACCEPTED, ERR_SLOT_CONFLICT):
        assert code in flashkda.DEVICE_ERRORS, f"flashkda.DEVICE_ERRORS lacks code {code}"


# ---------------------------------------------------------------------------------------------
# Plain decode (T = 1, 1-D indices)

@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H", [1, 16])
@pytest.mark.parametrize("N", [1, 3, 64])
def test_plain_decode(gen, N, H, D, state_dtype):
    inp = tokens(gen, N=N, T=1, H=H, D=D)
    P = 2 * N + 3
    pool = new_pool(gen, P, H, D, state_dtype)
    idx = perm(gen, P)[:N].to(torch.int32).to(DEV)  # rows in a random order, not 0..N-1
    check_decode(gen, inp, pool, idx)


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("gate_mode", ["softplus", "precomputed"])
def test_plain_decode_gate_modes(gen, gate_mode, D, state_dtype):
    inp = tokens(gen, N=3, T=1, H=16, D=D, gate_mode=gate_mode)
    pool = new_pool(gen, 9, 16, D, state_dtype)
    idx = perm(gen, 9)[:3].to(DEV)  # int64
    check_decode(gen, inp, pool, idx)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("use_beta_sigmoid", [True, False], ids=["sig", "nosig"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2", "nol2"])
def test_plain_decode_flags(gen, use_qk_l2norm, use_beta_sigmoid, D):
    inp = tokens(gen, N=5, T=1, H=16, D=D, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid)
    pool = new_pool(gen, 11, 16, D)
    idx = perm(gen, 11)[:5].to(torch.int32).to(DEV)
    check_decode(gen, inp, pool, idx)


def test_plain_decode_scale(gen):
    inp = tokens(gen, N=4, T=1, H=4, D=128)
    pool = new_pool(gen, 6, 4, 128)
    idx = perm(gen, 6)[:4].to(DEV)
    before = pool.clone()
    ref_out, ref_pool = R.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], before, idx, scale=0.3,
                                 **gate_kwargs(inp))
    out = torch.full(inp["v"].shape, NAN, dtype=BF16, device=DEV)
    flashkda.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, out, scale=0.3,
                    **gate_kwargs(inp), **CUDA_BACKEND)
    torch.cuda.synchronize()
    assert rel_err(out, ref_out) <= SPEC_OUT, f"seed {seed_of(gen)}"
    check_pool(gen, pool, before, ref_pool, SPEC_STATE)


def test_misaligned_pool_is_an_argument_error(gen):
    """The decode kernels move states in 16-byte pieces: a pool 4 bytes off is refused by validation."""
    inp = tokens(gen, N=2, T=1, H=4, D=64)
    pool = torch.zeros(3 * 4 * 64 * 64 + 1, device=DEV)[1:].view(3, 4, 64, 64)
    out = torch.full(inp["v"].shape, NAN, dtype=BF16, device=DEV)
    with pytest.raises(ValueError, match=r"argument 'state_pool': expected a 16-byte aligned data pointer"):
        flashkda.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                        torch.tensor([0, 1], device=DEV), out, **gate_kwargs(inp), **CUDA_BACKEND)
    assert torch.isnan(out.float()).all() and torch.count_nonzero(pool) == 0


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_plain_decode_fp32_gate_and_beta(gen, state_dtype):
    inp = tokens(gen, N=7, T=1, H=16, D=128, g_dtype=FP32, beta_dtype=FP32)
    pool = new_pool(gen, 15, 16, 128, state_dtype)
    check_decode(gen, inp, pool, perm(gen, 15)[:7].to(DEV))


def distinct_slots(gen, P, N, T):
    """Pool rows for N requests of T tokens, all distinct: 1-D indices for T = 1, else [N, T] indices
    and random num_accepted_tokens in 1..T."""
    if T == 1:
        return perm(gen, P)[:N].to(DEV), None
    idx = perm(gen, P)[:N * T].view(N, T).to(DEV)
    return idx, torch.randint(1, T + 1, (N,), generator=gen).to(DEV)


def check_same_as_dense(gen, inp, pool, idx, acc, names):
    """check_decode on inp, then the same call with the tensors `names` as dense copies on a copy of
    the pool: out and pool must be bitwise equal.  Returns the dense inputs and the dense run's pool."""
    pool2 = pool.clone()
    out, *_ = check_decode(gen, inp, pool, idx, acc)
    dense = dict(inp)
    for name in names:
        dense[name] = inp[name].contiguous()
    out2 = run_decode(dense, pool2, idx, acc)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and torch.equal(pool, pool2)
    return dense, pool2


@pytest.mark.parametrize("T", [1, 4])
def test_row_strided_inputs(gen, T):
    """q, k, v, g and beta as slices of wider per-token rows (beta row stride != H): read in place,
    bitwise the same as on dense copies."""
    N, H, D = 6, 16, 128
    inp = tokens(gen, N=N, T=T, H=H, D=D, strided=True)
    assert not inp["beta"].is_contiguous() and not inp["q"].is_contiguous()
    P = N * T + 5
    pool = new_pool(gen, P, H, D)
    idx, acc = distinct_slots(gen, P, N, T)
    check_same_as_dense(gen, inp, pool, idx, acc, ("q", "k", "v", "g", "beta"))


@pytest.mark.parametrize("T", [1, 3])
def test_two_byte_aligned_rows(gen, T):
    """q, k, v, g rows at an odd bf16 offset (2-byte aligned only: the pipelined kernel's element-wise
    staging path) and fp32 g at an offset of one float (4-byte pieces): bitwise the same as dense."""
    N, H, D = 5, 16, 128
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    for name in ("q", "k", "v", "g"):
        inp[name] = strided_copy(inp[name], pad=3, offset=1)
    assert inp["q"].data_ptr() % 4 == 2
    P = N * T + 3
    pool = new_pool(gen, P, H, D)
    idx, acc = distinct_slots(gen, P, N, T)
    dense, pool2 = check_same_as_dense(gen, inp, pool, idx, acc, ("q", "k", "v", "g"))
    g32 = dict(dense)
    g32["g"] = strided_copy(dense["g"].float(), pad=3, offset=1)
    assert g32["g"].data_ptr() % 8 == 4
    check_decode(gen, g32, pool2.clone(), idx, acc)


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [False, True], ids=["1d", "2d"])
def test_long_requests(gen, spec, state_dtype):
    """Requests longer than the tokens a stage holds (4): the rest are read from global memory."""
    rng = random.Random(seed_of(gen))
    lens = [rng.choice([0, 1, 4, 5, 7, 9]) for _ in range(13)] + [9]
    H, D = 8, 128
    inp = tokens(gen, lens=lens, H=H, D=D)
    N = len(lens)
    if spec:
        S = max(lens)
        P = N * S + 5
        idx = perm(gen, P)[:N * S].view(N, S).to(torch.int32).to(DEV)
        acc = torch.randint(1, S + 1, (N,), generator=gen, dtype=torch.int32).to(DEV)
    else:
        P = N + 5
        idx, acc = perm(gen, P)[:N].to(torch.int32).to(DEV), None
    check_decode(gen, inp, new_pool(gen, P, H, D, state_dtype), idx, acc)


@pytest.mark.parametrize("N", [1, 300])
def test_garbage_workspace_reports_this_call(gen, N):
    """The decode call rewrites the whole error header itself (no clearing node): a workspace full of
    garbage reads clean after a valid call, and a bad call then a valid one reads clean again."""
    H, D = 4, 128
    inp = tokens(gen, N=N, T=1, H=H, D=D)
    ws = torch.full((int(torch.ops.flashkda.get_decode_workspace_size()),), 0xAB, dtype=torch.uint8, device=DEV)
    P = N + 2
    check_decode(gen, inp, new_pool(gen, P, H, D), perm(gen, P)[:N].to(DEV), ws=ws)
    bad = perm(gen, P)[:N].to(DEV)
    bad[N // 2] = P  # out of range
    run_decode(inp, new_pool(gen, P, H, D), bad, ws=ws)
    assert flashkda.read_device_error(ws) == ERR_STATE_INDEX
    check_decode(gen, inp, new_pool(gen, P, H, D), perm(gen, P)[:N].to(DEV), ws=ws)


def test_many_items_per_block(gen):
    """More work items than blocks x 32 (the producer resolves items 32 at a time), with padding."""
    N, H, D = 300, 16, 128
    inp = tokens(gen, N=N, T=1, H=H, D=D)
    P = N + 7
    idx = perm(gen, P)[:N].to(DEV)
    idx[::17] = -1
    out, *_ = check_decode(gen, inp, new_pool(gen, P, H, D), idx)
    assert torch.count_nonzero(out[::17]) == 0


def test_strided_beta_only(gen):
    """Only beta is a slice of a fused projection (the common serving case)."""
    inp = tokens(gen, N=9, T=1, H=16, D=128)
    inp["beta"] = strided_copy(inp["beta"], pad=40, offset=3)
    assert not inp["beta"].is_contiguous()
    pool = new_pool(gen, 12, 16, 128)
    check_decode(gen, inp, pool, perm(gen, 12)[:9].to(DEV))


def test_plain_decode_padding(gen):
    inp = tokens(gen, N=6, T=1, H=16, D=128)
    pool = new_pool(gen, 10, 16, 128)
    idx = perm(gen, 10)[:6].to(DEV)
    idx[[1, 4]] = -1
    out, *_ = check_decode(gen, inp, pool, idx)
    assert torch.count_nonzero(out[[1, 4]]) == 0, f"seed {seed_of(gen)}: padded requests' out not zeroed"


# ---------------------------------------------------------------------------------------------
# Speculative decode (2-D indices, num_accepted_tokens)

def spec_indices(gen, N, S, P):
    """Distinct pool rows (a random permutation) [N, S] int32 and acceptance counts in 1..S."""
    idx = perm(gen, P)[:N * S].view(N, S).to(torch.int32)
    acc = torch.randint(1, S + 1, (N,), generator=gen, dtype=torch.int32)
    return idx, acc


def pool_indices(gen, N, S, P, spec):
    """On the GPU: spec_indices (2-D, with acceptance counts) or N distinct rows (1-D, None)."""
    if spec:
        idx, acc = spec_indices(gen, N, S, P)
        return idx.to(DEV), acc.to(DEV)
    return perm(gen, P)[:N].to(DEV), None


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [2, 4])
def test_spec_decode(gen, T, D, state_dtype):
    N, H = 37, 16
    P = N * T + 11
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, P, H, D, state_dtype)
    idx, acc = spec_indices(gen, N, T, P)
    check_decode(gen, inp, pool, idx.to(DEV), acc.to(DEV))


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 4, 6])
@pytest.mark.parametrize("N,H,D", [(1, 16, 128), (12, 16, 128), (40, 16, 64)], ids=["r1", "r2-d128", "r2-d64"])
def test_latency_kernel_slices(gen, N, H, D, T, state_dtype):
    """The latency kernel's two slice widths (one state row per thread when its grid fits 1024
    blocks, two rows for 8-15 requests of 16 heads at D = 128), plain (T = 1) and spec decode with one
    token group (T = 4) and two (T = 6)."""
    P = N * T + 5
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, P, H, D, state_dtype)
    if T == 1:
        check_decode(gen, inp, pool, perm(gen, P)[:N].to(DEV))
    else:
        idx, acc = spec_indices(gen, N, T, P)
        check_decode(gen, inp, pool, idx.to(DEV), acc.to(DEV))


@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "precomputed"])
def test_spec_decode_gate_modes_int64(gen, gate_mode):
    N, T, H, D = 5, 4, 4, 128
    P = N * T
    inp = tokens(gen, N=N, T=T, H=H, D=D, gate_mode=gate_mode, use_beta_sigmoid=gate_mode != "precomputed")
    pool = new_pool(gen, P, H, D)
    idx, acc = spec_indices(gen, N, T, P)
    check_decode(gen, inp, pool, idx.long().to(DEV), acc.long().to(DEV))


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_spec_decode_every_acceptance_count(gen, state_dtype):
    """Every acceptance count, each checked against prefills of the first t + 1 tokens."""
    N, T, H, D = 8, 4, 4, 128
    P = N * T + 2
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, P, H, D, state_dtype)
    idx, _ = spec_indices(gen, N, T, P)
    acc = torch.tensor([1, 2, 3, 4, 4, 3, 2, 1], dtype=torch.int32)
    before = pool.clone()
    check_decode(gen, inp, pool, idx.to(DEV), acc.to(DEV))
    tol = SPEC_STATE if state_dtype == FP32 else LOOSE_STATE
    for n in range(N):
        read = int(idx[n, int(acc[n]) - 1])
        for t in range(T):
            sub = {name: inp[name][n:n + 1, :t + 1] for name in ("q", "k", "v", "g", "beta")}
            _, fin = R.prefill(**sub, **gate_kwargs(inp), initial_state=before[read:read + 1])
            e = rel_err(pool[int(idx[n, t])], fin[0])
            assert e <= tol, f"seed {seed_of(gen)}: request {n} token {t}: rel {e:.3e}"


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_spec_decode_padding_and_skipped_writes(gen, state_dtype):
    """Negative read slots pad a request (zero out, its rows untouched); negative write slots skip
    one write.  The whole pool is compared against the expected pool (untouched rows bitwise)."""
    N, T, H, D = 24, 4, 16, 128
    P = N * T + 9
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, P, H, D, state_dtype)
    idx, acc = spec_indices(gen, N, T, P)
    rng = random.Random(seed_of(gen))
    padded = rng.sample(range(N), 5)
    for n in padded:
        idx[n, int(acc[n]) - 1] = -1  # the read slot: padding (its other slots stay valid rows)
    skipped = []
    for n in rng.sample([n for n in range(N) if n not in padded], 6):
        t = rng.choice([t for t in range(T) if t != int(acc[n]) - 1])
        skipped.append(int(idx[n, t]))
        idx[n, t] = -1
    before = pool.clone()
    out, *_ = check_decode(gen, inp, pool, idx.to(DEV), acc.to(DEV))
    assert torch.count_nonzero(out[padded]) == 0, f"seed {seed_of(gen)}: padded requests' out not zeroed"
    rows = [int(r) for n in padded for r in idx[n] if r >= 0] + skipped
    assert torch.equal(pool[rows], before[rows]), f"seed {seed_of(gen)}: padded / skipped rows were written"


def test_spec_decode_read_slot_not_written(gen):
    """The read slot may be a row the request does not write this step (acc - 1 past a skipped write)."""
    N, T, H, D = 4, 3, 4, 128
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, 16, H, D)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], dtype=torch.int32)
    acc = torch.tensor([3, 1, 2, 3], dtype=torch.int32)
    idx[0, 2] = 14  # request 0 reads row 14 and writes it (its last token)
    check_decode(gen, inp, pool, idx.to(DEV), acc.to(DEV))


# ---------------------------------------------------------------------------------------------
# Varlen (cu_seqlens), with empty requests

@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [False, True], ids=["1d", "2d"])
def test_varlen(gen, spec, state_dtype, cu_dtype):
    S = 4
    rng = random.Random(seed_of(gen))
    lens = [rng.choice([0, 0, 1, 1, 2, 3, 4]) for _ in range(29)] + [0, 4]
    if not spec:
        lens = [min(n, 2) for n in lens]  # plain decode: a token or two (or none)
    N, H, D = len(lens), 16, 128
    inp = tokens(gen, lens=lens, H=H, D=D, cu_dtype=cu_dtype)
    P = N * S + 7
    pool = new_pool(gen, P, H, D, state_dtype)
    if spec:
        idx, acc = spec_indices(gen, N, S, P)
        idx[3, int(acc[3]) - 1] = -1  # one padded request
        idx, acc = idx.to(DEV), acc.to(DEV)
    else:
        idx, acc = perm(gen, P)[:N].to(DEV), None
        idx[5] = -1
    out, *_ = check_decode(gen, inp, pool, idx, acc)
    cu = inp["cu_seqlens"].tolist()
    pad_n = 3 if spec else 5
    assert torch.count_nonzero(out[0, cu[pad_n]:cu[pad_n + 1]]) == 0


def test_varlen_all_empty(gen):
    inp = tokens(gen, lens=[0, 0, 0], H=4, D=128)
    pool = new_pool(gen, 5, 4, 128)
    before = pool.clone()
    run_decode(inp, pool, torch.tensor([4, 0, 2], device=DEV), ws=workspace())
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


@pytest.mark.parametrize("case", ["fixed_N0", "varlen_N0", "fixed_T0", "all_padded"])
def test_calls_with_no_state_to_update(gen, case):
    """No request (fixed N = 0, cu_seqlens = [0]), requests of no token, every request padded: the
    call launches validly or not at all, clears a stale error header, leaves the pool alone, and
    zeroes the padded requests' outputs."""
    none = torch.empty(0, dtype=torch.int32, device=DEV)
    inp, idx = {"fixed_N0": lambda: (tokens(gen, N=0), none),
                "varlen_N0": lambda: (tokens(gen, lens=[]), none),
                "fixed_T0": lambda: (tokens(gen, N=3, T=0), torch.tensor([4, 0, 2], device=DEV)),
                "all_padded": lambda: (tokens(gen, N=3), torch.tensor([-1, -2, -1], device=DEV))}[case]()
    pool = new_pool(gen, 6, 4, 128)
    before = pool.clone()
    ws = workspace()
    ws.fill_(0xFF)
    out = run_decode(inp, pool, idx, ws=ws)
    assert flashkda.read_device_error(ws) == 0, f"seed {seed_of(gen)}"
    assert torch.equal(pool, before), f"seed {seed_of(gen)}"
    assert torch.count_nonzero(out) == 0, f"seed {seed_of(gen)}"


def test_spec_decode_one_slot_a_request(gen):
    """2-D indices [N, 1] (no draft token): speculative decode of one token a request."""
    pool = new_pool(gen, 8, 4, 128)
    idx, acc = spec_indices(gen, 5, 1, 8)
    check_decode(gen, tokens(gen, N=5, T=1), pool, idx.to(DEV), acc.to(DEV))


def test_tokens_without_requests_are_an_argument_error(gen):
    """cu_seqlens = [0] with tokens present: refused from the shapes (no kernel request would see
    it), nothing written."""
    inp = tokens(gen, lens=[3])
    pool = new_pool(gen, 2, 4, 128)
    before = pool.clone()
    out = torch.full(inp["v"].shape, NAN, dtype=BF16, device=DEV)
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens': expected at least 2 elements \[N\+1\] for T = 3"):
        run_decode(inp, pool, torch.empty(0, dtype=torch.int32, device=DEV), out=out, ws=workspace(),
                   cu_seqlens=torch.zeros(1, dtype=torch.int32, device=DEV))
    assert torch.equal(pool, before) and torch.isnan(out.float()).all()


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_fla_dispatch_runs_the_decode_kernel(gen, spec):
    """flashkda.fla_backend.register(): fla's serving decode entry (fused_recurrent_kda_fwd on a V-first
    pool, in place) runs flashkda's decode, bit for bit what flashkda.decode(backend="cuda") does, and
    returns (out, the pool); fla's own kernel on the same call writes the same pool rows, within the
    contract's tolerances.  Skipped without fla."""
    fr = pytest.importorskip("fla.ops.kda.fused_recurrent")
    import flashkda.fla_backend as FLB
    N, T, H, D, P = 40, 4 if spec else 1, 16, 128, 200
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool = new_pool(gen, P, H, D)
    idx, acc = pool_indices(gen, N, T, P, spec)
    own_pool, pool_before = pool.clone(), pool.clone()
    FLB.register()
    try:
        with torch.no_grad():
            o_fla, ht = fr.fused_recurrent_kda_fwd(
                q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], A_log=inp["A_log"],
                dt_bias=inp["dt_bias"].flatten(), initial_state=pool, inplace_final_state=True, state_v_first=True,
                ssm_state_indices=idx, num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    finally:
        FLB.unregister()
    o_own = run_decode(inp, own_pool, idx, acc)
    # fla's own kernel on the same call (the function behind its dispatch): the same pool rows read and
    # written, to the contract's tolerances (no negative index here: fla's kernel would read before the pool).
    fla_pool = pool_before.clone()
    with torch.no_grad():
        o_triton, _ = inspect.unwrap(fr.fused_recurrent_kda_fwd)(
            q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], A_log=inp["A_log"],
            dt_bias=inp["dt_bias"].flatten(), initial_state=fla_pool, inplace_final_state=True, state_v_first=True,
            ssm_state_indices=idx, num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    torch.cuda.synchronize()
    assert ht is pool
    assert torch.equal(o_fla, o_own) and torch.equal(pool, own_pool), f"seed {seed_of(gen)}"
    assert rel_err(o_own, o_triton) <= SPEC_OUT, f"seed {seed_of(gen)}"
    assert rel_err(own_pool, fla_pool) <= SPEC_STATE, f"seed {seed_of(gen)}"
    written = lambda p: (p != pool_before).flatten(1).any(1)  # noqa: E731  (pool rows a call changed)
    assert torch.equal(written(own_pool), written(fla_pool)), f"seed {seed_of(gen)}: not the same rows written"


# ---------------------------------------------------------------------------------------------
# token_rows: logical token t reads / writes row token_rows[t] of dim 1

@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("spec", [False, True], ids=["1d", "2d"])
def test_token_rows(gen, spec, rows_dtype):
    S, H, D = 3, 16, 128
    rng = random.Random(seed_of(gen))
    lens = [rng.randint(0, S if spec else 1) for _ in range(12)]
    N, T_log = len(lens), sum(lens)
    R_rows = T_log + 9  # the call's buffers have more rows (e.g. a mixed prefill/decode step)
    big = tokens(gen, N=1, T=R_rows, H=H, D=D)  # [1, R_rows, ...]
    rows = perm(gen, R_rows)[:T_log]
    unmapped = sorted(set(range(R_rows)) - set(rows.tolist()))
    for name in ("q", "k", "v", "g", "beta"):  # rows no token maps to must not be read
        big[name][:, unmapped] = NAN
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(N)], dtype=torch.int32, device=DEV)
    logical = dict(big, cu_seqlens=cu)
    for name in ("q", "k", "v", "g", "beta"):
        logical[name] = big[name][:, rows.to(DEV)].contiguous()
    P = N * S + 4
    pool = new_pool(gen, P, H, D)
    idx, acc = pool_indices(gen, N, S, P, spec)
    before = pool.clone()
    ref_out, ref_pool = ref_decode(logical, before, idx, acc)
    out = torch.full(big["v"].shape, NAN, dtype=BF16, device=DEV)
    ws = workspace()
    run_decode(big, pool, idx, acc, out=out, ws=ws, token_rows=rows.to(device=DEV, dtype=rows_dtype),
               cu_seqlens=cu)
    torch.cuda.synchronize()
    assert flashkda.read_device_error(ws) == 0
    mapped = out[:, rows.to(DEV)]
    assert torch.isfinite(mapped.float()).all(), f"seed {seed_of(gen)}: a mapped row not written"
    assert rel_err(mapped, ref_out) <= SPEC_OUT, f"seed {seed_of(gen)}"
    assert torch.isnan(out[:, unmapped].float()).all(), f"seed {seed_of(gen)}: an unmapped out row was written"
    check_pool(gen, pool, before, ref_pool, SPEC_STATE)


# ---------------------------------------------------------------------------------------------
# Determinism and CUDA graphs

def test_deterministic(gen):
    N, T, H, D = 64, 4, 16, 128
    P = N * T + 3
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool0 = new_pool(gen, P, H, D)
    idx, acc = spec_indices(gen, N, T, P)
    idx, acc = idx.to(DEV), acc.to(DEV)
    results = []
    for _ in range(3):
        pool = pool0.clone()
        out = run_decode(inp, pool, idx, acc)
        results.append((out, pool))
    torch.cuda.synchronize()
    for out, pool in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(pool, results[0][1])


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_state_load_policy_is_bitwise_neutral(gen, dtype, monkeypatch):
    """The L2 policy of the pipelined kernel's state loads (FLASHKDA_DECODE_LOAD_POLICY, a dev switch
    read on every call) changes where lines live in L2, never a value: both policies give bitwise equal
    outputs and pools, and the right ones."""
    N, T, H, D = 64, 4, 16, 128
    P = N * T + 3
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    pool0 = new_pool(gen, P, H, D, dtype)
    idx, acc = spec_indices(gen, N, T, P)
    idx, acc = idx.to(DEV), acc.to(DEV)
    results = {}
    for policy in ("normal", "evict_first"):
        monkeypatch.setenv("FLASHKDA_DECODE_LOAD_POLICY", policy)
        pool = pool0.clone()
        out = check_decode(gen, inp, pool, idx, acc, what=f" policy {policy}")[0]
        results[policy] = (out, pool)
    torch.cuda.synchronize()
    (out_n, pool_n), (out_e, pool_e) = results["normal"], results["evict_first"]
    assert torch.equal(out_n, out_e), f"seed {seed_of(gen)}: outputs differ between the load policies"
    assert torch.equal(pool_n, pool_e), f"seed {seed_of(gen)}: pools differ between the load policies"


def test_cuda_graph_replay(gen):
    """Captured once, replayed with new inputs, indices, acceptance counts and pool contents copied
    into the static tensors: bitwise equal to eager calls, and right."""
    N, T, H, D = 16, 4, 4, 128
    P = N * T + 8

    def data(pad):
        inp = tokens(gen, N=N, T=T, H=H, D=D)
        idx, acc = spec_indices(gen, N, T, P)
        if pad:
            idx[3, int(acc[3]) - 1] = -1  # a padded request
            idx[7, int(acc[7]) % T] = -1  # a skipped write (not request 7's read slot)
        return inp, new_pool(gen, P, H, D), idx.to(DEV), acc.to(DEV)

    first, second = data(False), data(True)
    s_inp = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first[0].items()}
    s_pool, s_idx, s_acc = first[1].clone(), first[2].clone(), first[3].clone()
    out = torch.full(s_inp["v"].shape, NAN, dtype=BF16, device=DEV)
    ws = workspace()

    def call():
        run_decode(s_inp, s_pool, s_idx, s_acc, out=out, ws=ws)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for inp, pool, idx, acc in (first, second):
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
            s_inp[name].copy_(inp[name])
        s_pool.copy_(pool)
        s_idx.copy_(idx)
        s_acc.copy_(acc)
        out.fill_(NAN)
        graph.replay()
        e_pool = pool.clone()
        e_out = run_decode(inp, e_pool, idx, acc)
        torch.cuda.synchronize()
        assert flashkda.read_device_error(ws) == 0
        assert torch.equal(out, e_out) and torch.equal(s_pool, e_pool), f"seed {seed_of(gen)}: replay != eager"
        ref_out, ref_pool = ref_decode(inp, pool, idx, acc)
        assert rel_err(out, ref_out) <= SPEC_OUT, f"seed {seed_of(gen)}"
        check_pool(gen, s_pool, pool, ref_pool, SPEC_STATE)


# ---------------------------------------------------------------------------------------------
# Device-side validation of index values (CUDA tensors are not read by the host)

def _bad_call(gen, idx, acc=None, lens=None, token_rows=None, T=2):
    N, H, D = idx.shape[0], 4, 128
    if lens is not None:
        inp = tokens(gen, lens=lens, H=H, D=D)
    else:
        inp = tokens(gen, N=N, T=T, H=H, D=D)
    P = 12
    pool = new_pool(gen, P, H, D)
    before = pool.clone()
    ws = workspace()
    out = run_decode(inp, pool, idx.to(DEV), None if acc is None else acc.to(DEV), ws=ws,
                     token_rows=None if token_rows is None else token_rows.to(DEV))
    code = flashkda.read_device_error(ws)
    # a good call on the same workspace afterwards reports nothing
    flashkda.clear_device_error(ws)
    assert flashkda.read_device_error(ws) == 0
    return code, pool, before, out, inp, ws


def test_device_error_index_ge_P_1d(gen):
    code, pool, before, out, *_ = _bad_call(gen, torch.tensor([0, 12, 5]), T=1)
    assert code == ERR_STATE_INDEX, f"seed {seed_of(gen)}: device error {code}"
    assert torch.isfinite(pool.float()).all()


def test_device_error_index_ge_P_2d(gen):
    idx = torch.tensor([[0, 1], [2, 30], [4, 5]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 1], dtype=torch.int32)  # request 1 reads row 2, would write rows 2 and 30
    code, pool, before, *_ = _bad_call(gen, idx, acc)
    assert code == ERR_STATE_INDEX, f"seed {seed_of(gen)}: device error {code}"
    assert torch.equal(pool[2], before[2]), f"seed {seed_of(gen)}: the bad request's row was written"
    rows_never = [r for r in range(12) if r not in (0, 1, 2, 4, 5)]
    assert torch.equal(pool[rows_never], before[rows_never])


def test_device_error_read_slot_ge_P(gen):
    idx = torch.tensor([[0, 1], [99, 3], [4, 5]], dtype=torch.int32)
    acc = torch.tensor([1, 1, 2], dtype=torch.int32)
    code, pool, before, *_ = _bad_call(gen, idx, acc)
    assert code == ERR_STATE_INDEX, f"seed {seed_of(gen)}: device error {code}"
    assert torch.equal(pool[3], before[3]), f"seed {seed_of(gen)}: the bad request's row was written"


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=["idx64", "idx32"])
@pytest.mark.parametrize("case", ["dup_between_requests", "dup_in_request", "dup_1d", "cross_read_write",
                                  "read_written_by_other", "dup_1d_T2"])
def test_device_error_slot_conflict(gen, case, idx_dtype):
    """Int32 indices in the fixed layout reach the fixed-layout kernel's own conflict check."""
    acc, lens, T = torch.tensor([1, 2, 1], dtype=torch.int32), None, 2
    if case == "dup_between_requests":
        idx = torch.tensor([[0, 1], [2, 1], [4, 5]])
    elif case == "dup_in_request":
        idx = torch.tensor([[0, 0], [2, 3], [4, 5]])
    elif case == "dup_1d":
        idx, acc, T = torch.tensor([4, 1, 4]), None, 1
    elif case == "dup_1d_T2":
        idx, acc = torch.tensor([7, 1, 7]), None
    elif case == "read_written_by_other":  # request 1 reads row 3 (acc 2); request 2 writes it
        idx = torch.tensor([[0, 1], [2, 3], [3, 5]])
    else:  # varlen 1, 0, 2 tokens: request 0 reads row 5 (column 1, which it does not write) and request 2 writes it
        idx, acc, lens = torch.tensor([[0, 5], [2, 3], [4, 5]]), torch.tensor([2, 1, 1]), [1, 0, 2]
    code, pool, *_ = _bad_call(gen, idx.to(idx_dtype), acc, lens=lens, T=T)
    assert code == ERR_SLOT_CONFLICT, f"seed {seed_of(gen)}: device error {code}"
    assert torch.isfinite(pool.float()).all()


def test_no_conflict_reported_for_distinct_rows_idx32(gen):
    """The fixed-layout conflict check does not flag distinct rows, padding or a row only read."""
    idx = torch.tensor([[0, 1], [-1, 1], [4, 5], [6, 7]], dtype=torch.int32)  # request 1 padded
    acc = torch.tensor([1, 1, 2, 1], dtype=torch.int32)
    code, *_ = _bad_call(gen, idx, acc)
    assert code == 0, f"seed {seed_of(gen)}: device error {code}"


@pytest.mark.parametrize("slot", [12, -1], ids=["ge_P", "padded"])
def test_single_request_plain_idx32(gen, slot):
    """Plain decode of one request (the grid without a checker block): a bad slot is reported and
    writes nothing; a padded request zeroes its output and touches no state."""
    code, pool, before, out, *_ = _bad_call(gen, torch.tensor([slot], dtype=torch.int32), T=1)
    assert torch.equal(pool, before), f"seed {seed_of(gen)}: the pool was written"
    if slot < 0:
        assert code == 0, f"seed {seed_of(gen)}: device error {code}"
        assert torch.equal(out, torch.zeros_like(out)), f"seed {seed_of(gen)}: padded output not zero"
    else:
        assert code == ERR_STATE_INDEX, f"seed {seed_of(gen)}: device error {code}"


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_device_error_num_accepted(gen, bad):
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    acc = torch.tensor([1, bad, 2], dtype=torch.int32)
    code, pool, before, *_ = _bad_call(gen, idx, acc)
    assert code == ERR_ACCEPTED, f"seed {seed_of(gen)}: device error {code}"
    assert torch.equal(pool[[2, 3]], before[[2, 3]]), f"seed {seed_of(gen)}: the bad request's rows were written"


def test_device_error_token_row(gen):
    lens = [1, 2]
    idx = torch.tensor([3, 7])
    code, pool, before, out, *_ = _bad_call(gen, idx, lens=lens, token_rows=torch.tensor([0, 5, 1]))
    assert code == ERR_TOKEN_ROW, f"seed {seed_of(gen)}: device error {code}"
    assert torch.isfinite(pool.float()).all()


def test_device_error_then_good_call(gen):
    """A bad call records its error; a good call on the same workspace afterwards runs and records 0."""
    code, pool, before, out, inp, ws = _bad_call(gen, torch.tensor([0, 40, 5]), T=1)
    assert code == ERR_STATE_INDEX
    check_decode(gen, inp, pool, torch.tensor([0, 4, 5], device=DEV), ws=ws)


# ---------------------------------------------------------------------------------------------
# A serving simulation: 200 steps of CUDA prefills (new and continued), plain decode and spec decode
# with random acceptance on one pool, checked against each request's accepted token stream run
# through the float64 reference.

@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_serving_simulation(gen, state_dtype):
    seed = seed_of(gen)
    ws = workspace()

    def no_device_error(step):
        assert flashkda.read_device_error(ws) == 0, f"seed {seed} step {step}: device error"

    # bf16 pool: one rounding per call, accumulated over a request's life (the gate forgets most of it)
    fp32 = state_dtype == FP32
    run_pool_simulation(gen=gen, rng=random.Random(seed), device=DEV, state_dtype=state_dtype, H=4, D=128, P=44,
                        new_len=40, cont_len=70, out_tol=SPEC_OUT if fp32 else LOOSE_OUT,
                        state_tol=SPEC_STATE if fp32 else LOOSE_STATE, out_fill=NAN,
                        decode_op=lambda inp, pool, idx, acc=None: run_decode(inp, pool, idx, acc, ws=ws),
                        step_check=no_device_error, seed=seed)


# ---------------------------------------------------------------------------------------------
# Many plain requests in the fixed layout (the stream kernel under the default choice): padding, a
# bad slot and a conflict among more requests than the one-wave kernels take.

@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
def test_many_plain_requests_with_padding(gen, D, state_dtype):
    N, H = 300, 4
    inp = tokens(gen, N=N, T=1, H=H, D=D)
    P = N + 7
    idx = perm(gen, P)[:N].to(torch.int32)
    idx[torch.randperm(N, generator=gen)[:13]] = -1  # padded requests
    check_decode(gen, inp, new_pool(gen, P, H, D, state_dtype), idx.to(DEV))


@pytest.mark.parametrize("bad", ["ge_P", "dup"])
def test_many_plain_requests_device_error(gen, bad):
    N, H, D = 200, 4, 128
    inp = tokens(gen, N=N, T=1, H=H, D=D)
    P = N + 5
    idx = perm(gen, P)[:N].to(torch.int32)
    k = int(torch.randint(N, (1,), generator=gen))
    if bad == "ge_P":
        idx[k] = P + 3
    else:
        idx[k] = idx[(k + 1 + int(torch.randint(N - 1, (1,), generator=gen))) % N]
    pool = new_pool(gen, P, H, D)
    before = pool.clone()
    ws = workspace()
    run_decode(inp, pool, idx.to(DEV), ws=ws)
    code = flashkda.read_device_error(ws)
    if bad == "ge_P":
        assert code == ERR_STATE_INDEX, f"seed {seed_of(gen)}: device error {code}"
        untouched = [r for r in range(P) if r not in set(idx.tolist())]
        assert torch.equal(pool[untouched], before[untouched]), f"seed {seed_of(gen)}: rows no request owns changed"
    else:
        assert code == ERR_SLOT_CONFLICT, f"seed {seed_of(gen)}: device error {code}"
    assert torch.isfinite(pool.float()).all()


# ---------------------------------------------------------------------------------------------
# Many spec-decode / several-token requests in the fixed layout (bf16 pools: the spec stream kernel
# under the default choice; fp32: the pipelined kernel): padding, skipped writes, and each device
# error among more requests than the one-wave kernels take.

@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_many_spec_requests(gen, T, D, state_dtype):
    N, H = 300, 4
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    P = N * T + 9
    idx, acc = spec_indices(gen, N, T, P)
    rng = random.Random(seed_of(gen))
    for n in rng.sample(range(N), 11):
        idx[n, int(acc[n]) - 1] = -1  # padded requests
    for n in rng.sample(range(N), 17):  # skipped writes (a token's state not kept)
        t = rng.randrange(T)
        if t != int(acc[n]) - 1:
            idx[n, t] = -1
    check_decode(gen, inp, new_pool(gen, P, H, D, state_dtype), idx.to(DEV), acc.to(DEV))


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_many_plain_requests_several_tokens(gen, state_dtype):
    N, T, H, D = 300, 3, 4, 128
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    P = N + 7
    idx = perm(gen, P)[:N].to(torch.int32)
    idx[torch.randperm(N, generator=gen)[:9]] = -1
    check_decode(gen, inp, new_pool(gen, P, H, D, state_dtype), idx.to(DEV))


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad", ["acc_0", "acc_gt_S", "ge_P_read", "ge_P_write", "dup_write", "read_written"])
def test_many_spec_requests_device_error(gen, bad, state_dtype):
    N, T, H, D = 200, 4, 4, 128
    S = T
    inp = tokens(gen, N=N, T=T, H=H, D=D)
    P = N * S + 5
    idx, acc = spec_indices(gen, N, S, P)
    k = int(torch.randint(N, (1,), generator=gen))
    m = (k + 1 + int(torch.randint(N - 1, (1,), generator=gen))) % N
    expect = ERR_STATE_INDEX
    if bad == "acc_0":
        acc[k], expect = 0, ERR_ACCEPTED
    elif bad == "acc_gt_S":
        acc[k], expect = S + 1, ERR_ACCEPTED
    elif bad == "ge_P_read":
        idx[k, int(acc[k]) - 1] = P + 2
    elif bad == "ge_P_write":
        idx[k, int(acc[k]) % T] = P  # a write slot other than the read slot
    elif bad == "dup_write":
        idx[k, 1], expect = idx[m, 2], ERR_SLOT_CONFLICT
    else:  # request k writes the row request m reads
        idx[k, 0], expect = idx[m, int(acc[m]) - 1], ERR_SLOT_CONFLICT
    pool = new_pool(gen, P, H, D, state_dtype)
    before = pool.clone()
    ws = workspace()
    run_decode(inp, pool, idx.to(DEV), acc.to(DEV), ws=ws)
    code = flashkda.read_device_error(ws)
    assert code == expect, f"seed {seed_of(gen)}: device error {code}, expected {expect}"
    owned = set(int(r) for r in idx.flatten() if 0 <= r < P)
    untouched = [r for r in range(P) if r not in owned]
    assert torch.equal(pool[untouched], before[untouched]), f"seed {seed_of(gen)}: rows no request owns changed"
    if expect != ERR_SLOT_CONFLICT:  # the bad request writes nothing
        rows = [int(r) for r in idx[k] if 0 <= r < P]
        assert torch.equal(pool[rows], before[rows]), f"seed {seed_of(gen)}: the bad request's rows were written"
    assert torch.isfinite(pool.float()).all()
