"""flashkda.decode (recurrent decode / speculative decode on a state pool) and prefill checkpoint
states, on CPU, against the float64 reference (flashkda.reference.decode / prefill)."""

import importlib
import random
import re

import pytest
import torch

import flashkda
from flashkda import reference as R
from kda_helpers import BF16, SENTINEL, make_inputs, rel_err
from pool_simulation import run_pool_simulation

H, D = 2, 64
OUT_TOL = 1e-2  # out is bf16: one rounding gives ~2e-3
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NUM_SPEC = 3
T_SPEC = NUM_SPEC + 1

DECODE_SCHEMA = (
    "flashkda::decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, Tensor(b!) state_pool, "
    "Tensor ssm_state_indices, *, Tensor? num_accepted_tokens=None, Tensor? cu_seqlens=None, float scale=0.0, "
    "str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, float lower_bound=-5.0, "
    "bool use_qk_l2norm=True, bool use_beta_sigmoid=True, Tensor(c!)? workspace=None, Tensor? token_rows=None) -> ()"
)

_GATE_KEYS = ("gate_mode", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm", "use_beta_sigmoid")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tokens(gen, N=1, T=1, lens=None, **kw):
    """Random token inputs: fixed [N, T] or varlen (lens)."""
    return make_inputs(lens, B=N, T=T, H=H, D=D, with_initial_state=False, generator=gen, **kw)


def new_pool(P, dtype, gen):
    return (0.1 * torch.randn(P, H, D, D, generator=gen)).to(dtype)


def gate_kwargs(inp):
    return {key: inp[key] for key in _GATE_KEYS}


def op_decode(inp, pool, idx, acc=None, out=None):
    if out is None:
        out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    ret = flashkda.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, out,
                          num_accepted_tokens=acc, cu_seqlens=inp["cu_seqlens"], **gate_kwargs(inp))
    assert ret is out
    return out


def ref_decode(inp, pool, idx, acc=None):
    return R.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, num_accepted_tokens=acc,
                    cu_seqlens=inp["cu_seqlens"], **gate_kwargs(inp))


def check_decode(inp, pool, idx, acc=None):
    """Runs the op on a copy of `pool` and compares out and every pool row with the reference."""
    before = pool.clone()
    ref_out, ref_pool = ref_decode(inp, before, idx, acc)
    out = op_decode(inp, pool, idx, acc)
    assert rel_err(out, ref_out) < OUT_TOL
    assert not torch.any(out == SENTINEL)
    for row in range(pool.shape[0]):
        if torch.equal(ref_pool[row], before[row].double()):
            assert torch.equal(pool[row], before[row]), f"pool row {row} was written"
        else:
            assert rel_err(pool[row], ref_pool[row]) < STATE_TOL[pool.dtype], f"pool row {row}"
    return out, ref_pool


def test_decode_schema():
    assert torch.ops.flashkda.decode.default._schema == torch._C.parse_schema(DECODE_SCHEMA)
    assert str(torch.ops.flashkda.decode.default._schema) == str(torch._C.parse_schema(DECODE_SCHEMA))
    assert str(torch.ops.flashkda.get_decode_workspace_size.default._schema) == (
        "flashkda::get_decode_workspace_size() -> int")
    assert torch.ops.flashkda.get_decode_workspace_size() == flashkda.get_decode_workspace_size() == 4096
    assert flashkda.new_decode_workspace(torch.empty(1, 1, 2, 64)) is None  # CPU needs none


# ---------------------------------------------------------------------------------------------
# Plain decode (1-D indices)

@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "precomputed"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_plain_decode(gate_mode, state_dtype):
    gen = torch.Generator().manual_seed(["bounded", "softplus", "precomputed"].index(gate_mode) + 3 * (state_dtype == BF16))
    inp = tokens(gen, N=4, T=1, gate_mode=gate_mode)
    pool = new_pool(7, state_dtype, gen)
    idx = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    check_decode(inp, pool, idx)


@pytest.mark.parametrize("flags", [(True, True), (False, False), (True, False)])
def test_plain_decode_flags_scale_and_varlen(flags):
    gen = torch.Generator().manual_seed(7 + flags[0] + 2 * flags[1])
    inp = tokens(gen, lens=[1, 0, 3, 1], use_qk_l2norm=flags[0], use_beta_sigmoid=flags[1])
    pool = new_pool(5, torch.float32, gen)
    idx = torch.tensor([4, 1, 0, -1], dtype=torch.int64)  # the last request is padding
    out, _ = check_decode(inp, pool, idx)
    assert torch.count_nonzero(out[0, 4]) == 0


def test_plain_decode_equals_prefill_on_the_pool():
    gen = torch.Generator().manual_seed(8)
    inp = tokens(gen, N=3, T=2)
    pool = new_pool(4, torch.float32, gen)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32)
    pool2 = pool.clone()
    out = op_decode(inp, pool, idx)
    out2 = flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate_kwargs(inp),
                            initial_state=pool2, final_state=pool2, state_indices=idx)
    assert torch.equal(out, out2) and torch.equal(pool, pool2)


# ---------------------------------------------------------------------------------------------
# Speculative decode (2-D indices)

def spec_rows(N, P_offset=0):
    """Request n owns pool rows P_offset + [n * T_SPEC, (n + 1) * T_SPEC), in a shuffled column order."""
    return torch.tensor([[P_offset + n * T_SPEC + (t * 3 + n) % T_SPEC for t in range(T_SPEC)] for n in range(N)],
                        dtype=torch.int32)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accepted", list(range(1, T_SPEC + 1)) + ["mixed"])
def test_spec_decode_every_acceptance_count(state_dtype, accepted):
    gen = torch.Generator().manual_seed(20 + (0 if accepted == "mixed" else accepted) + 10 * (state_dtype == BF16))
    N = 4
    inp = tokens(gen, N=N, T=T_SPEC)
    pool = new_pool(N * T_SPEC + 3, state_dtype, gen)
    idx = spec_rows(N, 1)
    if accepted == "mixed":
        acc = torch.tensor([1, 4, 2, 3], dtype=torch.int64)
    else:
        acc = torch.full((N,), accepted, dtype=torch.int32)
    before = pool.clone()
    check_decode(inp, pool, idx, acc)
    # independently of R.decode: the state after token t is the final state of a prefill of the
    # first t + 1 tokens started from the read slot
    for n in range(N):
        read = int(idx[n, int(acc[n]) - 1])
        for t in range(T_SPEC):
            sub = {name: inp[name][n:n + 1, :t + 1] for name in ("q", "k", "v", "g", "beta")}
            _, fin = R.prefill(**sub, **gate_kwargs(inp), initial_state=before[read:read + 1])
            assert rel_err(pool[int(idx[n, t])], fin[0]) < STATE_TOL[state_dtype]


def test_spec_decode_padding_and_skipped_writes():
    gen = torch.Generator().manual_seed(30)
    inp = tokens(gen, N=3, T=3)
    pool = new_pool(9, torch.float32, gen)
    idx = torch.tensor([[0, 1, 2], [-1, 4, 5], [6, -1, 8]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)  # request 1 reads idx[1, 0] = -1: padded
    before = pool.clone()
    out, _ = check_decode(inp, pool, idx, acc)
    assert torch.count_nonzero(out[1]) == 0
    for row in (3, 4, 5, 7):  # the padded request's rows and the skipped write stay as they were
        assert torch.equal(pool[row], before[row])


def test_spec_decode_read_slot_is_a_write_slot():
    gen = torch.Generator().manual_seed(31)
    inp = tokens(gen, N=1, T=3)
    pool = new_pool(6, torch.float32, gen)
    copy = pool.clone()
    copy[5] = pool[1]
    out1 = op_decode(inp, pool, torch.tensor([[0, 1, 2]]), torch.tensor([2]))  # reads row 1, then writes it
    out2 = op_decode(inp, copy, torch.tensor([[0, 5, 2]]), torch.tensor([2]))  # the same start, from row 5
    assert torch.equal(out1, out2)
    assert torch.equal(pool[[0, 2]], copy[[0, 2]]) and torch.equal(pool[1], copy[5])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_spec_decode_varlen(state_dtype):
    gen = torch.Generator().manual_seed(32)
    inp = tokens(gen, lens=[2, 0, 3, 1])
    pool = new_pool(14, state_dtype, gen)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, -1, 11]], dtype=torch.int64)
    acc = torch.tensor([3, 2, 1, 1], dtype=torch.int32)  # request 0 reads column 2, which it does not write
    check_decode(inp, pool, idx, acc)


def test_opcheck_decode():
    gen = torch.Generator().manual_seed(33)
    inp = tokens(gen, N=2, T=T_SPEC)
    pool = new_pool(2 * T_SPEC, torch.float32, gen)
    out = torch.empty(inp["v"].shape, dtype=BF16)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, pool, spec_rows(2))
    torch.library.opcheck(torch.ops.flashkda.decode.default, args,
                          dict(num_accepted_tokens=torch.tensor([2, 4]), A_log=inp["A_log"], dt_bias=inp["dt_bias"]))
    inp = tokens(gen, N=3, T=1)
    out = torch.empty(inp["v"].shape, dtype=BF16)
    torch.library.opcheck(torch.ops.flashkda.decode.default,
                          (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, pool,
                           torch.tensor([5, -1, 0])), dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_op_on_cuda_needs_a_workspace():
    gen = torch.Generator().manual_seed(34)
    inp = tokens(gen, N=2, T=1, device="cuda")
    pool = torch.full((3, H, D, D), SENTINEL, device="cuda")
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16, device="cuda")
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, pool, torch.tensor([0, 2], device="cuda"))
    # ValueError naming the workspace on an sm_90 CUDA build; RuntimeError (unsupported device) elsewhere
    with pytest.raises((ValueError, RuntimeError)) as info:
        torch.ops.flashkda.decode(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    if isinstance(info.value, ValueError):
        assert "flashkda: argument 'workspace': expected a uint8 tensor on cuda" in str(info.value)
    small = torch.empty(8, dtype=torch.uint8, device="cuda")
    with pytest.raises((ValueError, RuntimeError)):
        torch.ops.flashkda.decode(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], workspace=small)
    torch.cuda.synchronize()
    assert torch.all(out == SENTINEL) and torch.all(pool == SENTINEL)


# ---------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument, nothing written

N_BAD = 3


def bad_base():
    gen = torch.Generator().manual_seed(40)
    inp = tokens(gen, N=N_BAD, T=2)
    a = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
             out=torch.full(inp["v"].shape, SENTINEL, dtype=BF16),
             state_pool=torch.full((8, H, D, D), SENTINEL), ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, 5]]))
    kw = dict(num_accepted_tokens=torch.tensor([1, 2, 1]), A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    return a, kw


def varlen_layout(a, kw):
    """Token counts 1, 0, 2 (cu_seqlens [0, 1, 1, 3]) with 2 slots per request."""
    for name in ("q", "k", "v", "g", "beta"):
        a[name] = a[name].reshape(1, -1, *a[name].shape[2:])[:, :3]
    a["out"] = torch.full((1, 3, H, D), SENTINEL, dtype=BF16)
    kw["cu_seqlens"] = torch.tensor([0, 1, 1, 3], dtype=torch.int32)


def setter(where, **new):
    def f(a, kw):
        (a if where == "a" else kw).update(new)
    return f


def plain(idx):
    def f(a, kw):
        a["ssm_state_indices"] = idx
        kw.pop("num_accepted_tokens")
    return f


def cross_read_write(a, kw):
    varlen_layout(a, kw)
    a["ssm_state_indices"] = torch.tensor([[0, 5], [2, 3], [4, 5]])  # request 0 reads row 5 (column 1) ...
    kw["num_accepted_tokens"] = torch.tensor([2, 1, 1])               # ... which request 2 writes


def varlen_too_few_slots(a, kw):
    varlen_layout(a, kw)
    kw["cu_seqlens"] = torch.tensor([0, 3, 3, 3], dtype=torch.int32)


def varlen_plain(cu, token_rows=None):
    """Plain decode (1-D indices [0, 1, 2]) of the varlen layout's 3 rows, with `cu` (and token_rows)."""
    def f(a, kw):
        varlen_layout(a, kw)
        a["ssm_state_indices"] = torch.tensor([0, 1, 2])
        kw.pop("num_accepted_tokens")
        kw.update(cu_seqlens=torch.tensor(cu, dtype=torch.int32), token_rows=token_rows)
    return f


def out_in_pool(a, kw):
    """out made of the pool's first bytes (the pool is poisoned too: nothing may be written)."""
    out = a["out"]
    a["out"] = a["state_pool"].view(-1).view(BF16)[:out.numel()].view(out.shape)


IDX = "ssm_state_indices"
ACC = "num_accepted_tokens"
# (id, mutation, argument named[, what the message must also say])
CASES = [
    ("index_ge_P_2d", setter("a", ssm_state_indices=torch.tensor([[0, 1], [2, 8], [4, 5]])), IDX),
    ("index_ge_P_1d", plain(torch.tensor([0, 9, 1])), IDX),
    ("duplicate_write_rows", setter("a", ssm_state_indices=torch.tensor([[0, 1], [2, 1], [4, 5]])), IDX),
    ("duplicate_write_in_row", setter("a", ssm_state_indices=torch.tensor([[0, 0], [2, 3], [4, 5]])), IDX),
    ("duplicate_write_1d", plain(torch.tensor([4, 1, 4])), IDX),
    ("cross_read_write", cross_read_write, IDX),
    ("varlen_too_few_slots", varlen_too_few_slots, IDX),
    ("num_accepted_zero", setter("kw", num_accepted_tokens=torch.tensor([1, 0, 1])), ACC),
    ("num_accepted_above_T", setter("kw", num_accepted_tokens=torch.tensor([1, 3, 1])), ACC),
    ("num_accepted_missing", setter("kw", num_accepted_tokens=None), ACC),
    ("num_accepted_with_1d", setter("a", ssm_state_indices=torch.tensor([0, 1, 2])), ACC),
    ("num_accepted_dtype", setter("kw", num_accepted_tokens=torch.tensor([1.0, 2.0, 1.0])), ACC),
    ("num_accepted_len", setter("kw", num_accepted_tokens=torch.tensor([1, 2])), ACC),
    ("indices_dtype", setter("a", ssm_state_indices=torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])), IDX),
    ("indices_cols_ne_T", setter("a", ssm_state_indices=torch.tensor([[0, 1, 6], [2, 3, 7], [4, 5, -1]])), IDX),
    ("indices_rank3", setter("a", ssm_state_indices=torch.zeros(3, 2, 1, dtype=torch.int64)), IDX),
    ("pool_dtype", setter("a", state_pool=torch.full((8, H, D, D), SENTINEL, dtype=torch.float16)), "state_pool"),
    ("pool_heads", setter("a", state_pool=torch.full((8, H + 1, D, D), SENTINEL)), "state_pool"),
    ("pool_transposed", setter("a", state_pool=torch.full((8, H, D, D), SENTINEL).transpose(-1, -2)), "state_pool"),
    ("q_dtype", setter("a", q=torch.randn(N_BAD, 2, H, D)), "q"),
    ("v_shape", setter("a", v=torch.randn(N_BAD, 3, H, D).to(BF16)), "v"),
    ("out_dtype", setter("a", out=torch.full((N_BAD, 2, H, D), SENTINEL)), "out"),
    ("A_log_missing", setter("kw", A_log=None), "A_log"),
    ("gate_mode", setter("kw", gate_mode="tanh"), "gate_mode"),
    ("lower_bound", setter("kw", lower_bound=-7.0), "lower_bound"),
    ("cu_seqlens_batch", setter("kw", cu_seqlens=torch.tensor([0, 1, 2, 2], dtype=torch.int32)), "cu_seqlens"),
    ("cu_seqlens_decreasing", varlen_plain([0, 2, 1, 3]), "cu_seqlens", r"non-decreasing values"),
    ("cu_seqlens_end", varlen_plain([0, 1, 2, 2]), "cu_seqlens", r"cu_seqlens\[3\] == T = 3, got 2$"),
    # No request, yet tokens: refused from the shapes (on CUDA too, where no kernel request would see it).
    ("cu_seqlens_no_request", varlen_plain([0]), "cu_seqlens", r"at least 2 elements \[N\+1\] for T = 3 tokens, got \[1\]$"),
    ("cu_seqlens_no_request_rows", varlen_plain([0], torch.tensor([0, 1, 2])), "cu_seqlens",
     r"at least 2 elements \[N\+1\] for T = 3 tokens \(the length of token_rows\), got \[1\]$"),
    ("token_rows_range", varlen_plain([0, 1, 2, 3], torch.tensor([0, 1, 3])), "token_rows",
     r"values in \[0, 3\) .*, got token_rows\[2\] = 3$"),
    ("token_rows_duplicate", varlen_plain([0, 1, 2, 3], torch.tensor([0, 2, 2])), "token_rows",
     r"distinct values .*, got token_rows\[2\] = token_rows\[1\] = 2$"),
    ("out_shares_pool", out_in_pool, "out",
     r"expected no memory shared with state_pool, got an overlap with state_pool$"),
    ("num_accepted_rank2", setter("kw", num_accepted_tokens=torch.tensor([[1], [2], [1]])), ACC,
     r"expected rank 1 \[N\], got rank 2 \[3, 1\]$"),
    ("num_accepted_strided", setter("kw", num_accepted_tokens=torch.tensor([1, 0, 2, 0, 1, 0])[::2]), ACC,
     r"expected a contiguous tensor, got strides \[2\]$"),
    ("indices_1d_strided", plain(torch.tensor([0, 9, 1, 9, 2, 9])[::2]), IDX,
     r"expected a contiguous tensor, got strides \[2\]$"),
    ("q_int16", setter("a", q=torch.zeros(N_BAD, 2, H, D, dtype=torch.int16)), "q",
     r"expected dtype bfloat16, got int16$"),
]


def _case_params(cases):
    return [(c[1], c[2], c[3] if len(c) > 3 else "") for c in cases]


@pytest.mark.parametrize("mutate,arg,match", _case_params(CASES), ids=[c[0] for c in CASES])
def test_decode_bad_input(mutate, arg, match):
    a, kw = bad_base()
    mutate(a, kw)
    out, pool = a["out"], a["state_pool"]
    out_before, pool_before = out.clone(), pool.clone()
    with pytest.raises(ValueError) as info:
        torch.ops.flashkda.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], out, pool, a["ssm_state_indices"],
                                  **kw)
    msg = str(info.value)
    assert f"flashkda: argument '{arg}': expected " in msg, msg
    assert re.search(match, msg), msg
    assert torch.equal(out, out_before)
    assert torch.equal(pool, pool_before)


@pytest.mark.parametrize("mutate", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_decode_check_says_what_decode_says(mutate):
    """torch.ops.flashkda.decode_check (the op's checks alone, no workspace: kda_step's validation of
    every group) raises decode's own error, writing nothing."""
    a, kw = bad_base()
    mutate(a, kw)
    out, pool = a["out"], a["state_pool"]
    out_before, pool_before = out.clone(), pool.clone()
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], out, pool, a["ssm_state_indices"])
    with pytest.raises(ValueError) as run_err:
        torch.ops.flashkda.decode(*args, **kw)
    check_kw = {key: val for key, val in kw.items() if key != "workspace"}
    with pytest.raises(ValueError) as check_err:
        torch.ops.flashkda.decode_check(*args, **check_kw)
    assert str(check_err.value) == str(run_err.value)
    assert torch.equal(out, out_before) and torch.equal(pool, pool_before)


FD = importlib.import_module("flashkda.decode")  # (the attribute flashkda.decode is the function)
FB = importlib.import_module("flashkda.backend")
# The paths that run CUDA tensors without the op (backend "reference": the float64 PyTorch reference;
# "triton": fla's fused_recurrent_kda) check what the op checks, in its words, except what they do
# not need: they take any floating dtype and any strides, and the gate is the reference's own.
NOT_FALLBACK_RULES = {"q_dtype", "q_int16", "out_dtype", "pool_dtype", "pool_transposed", "A_log_missing", "gate_mode",
                      "lower_bound", "num_accepted_strided", "indices_1d_strided"}
FALLBACK_CASES = [c for c in CASES if c[0] not in NOT_FALLBACK_RULES]


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("mutate", [c[1] for c in FALLBACK_CASES], ids=[c[0] for c in FALLBACK_CASES])
def test_decode_fallback_paths_check_like_the_op(monkeypatch, path, mutate):
    a, kw = bad_base()
    mutate(a, kw)
    out, pool = a["out"], a["state_pool"]
    out_before, pool_before = out.clone(), pool.clone()
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    with pytest.raises(ValueError) as op_error:
        torch.ops.flashkda.decode(*args, out, pool, a["ssm_state_indices"], **kw)
    monkeypatch.setattr(FB, "fla_function", lambda kind: pytest.fail("fla reached with invalid arguments"))
    opts = dict(num_accepted_tokens=None, cu_seqlens=None, scale=None, gate_mode="bounded", lower_bound=-5.0,
                use_qk_l2norm=True, use_beta_sigmoid=True, token_rows=None)
    opts.update(kw)
    run = FD._torch_reference_decode if path == "reference" else FD._triton_decode
    with pytest.raises(ValueError) as info:
        run(*args, pool, a["ssm_state_indices"], out, **opts)
    assert str(info.value) == str(op_error.value)
    assert torch.equal(out, out_before) and torch.equal(pool, pool_before)


def test_decode_bad_input_base_is_valid():
    a, kw = bad_base()
    a["state_pool"].normal_()
    torch.ops.flashkda.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], a["out"], a["state_pool"],
                              a["ssm_state_indices"], **kw)
    assert not torch.any(a["out"] == SENTINEL)
    a, kw = bad_base()
    varlen_layout(a, kw)
    a["state_pool"].normal_()
    torch.ops.flashkda.decode(a["q"], a["k"], a["v"], a["g"], a["beta"], a["out"], a["state_pool"],
                              a["ssm_state_indices"], **kw)


# ---------------------------------------------------------------------------------------------
# Prefill checkpoint states

def prefill_with_checkpoints(inp, offsets, final_dtype=torch.float32, **extra):
    N = offsets.shape[0]
    ckpt = torch.full((N, offsets.shape[1], H, D, D), SENTINEL)
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    fs = extra.pop("final_state", None)
    if fs is None:
        fs = torch.full((N, H, D, D), SENTINEL, dtype=final_dtype)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **gate_kwargs(inp),
                     initial_state=extra.pop("initial_state", inp["initial_state"]), final_state=fs,
                     cu_seqlens=inp["cu_seqlens"], checkpoint_offsets=offsets, checkpoint_state=ckpt, **extra)
    return out, fs, ckpt


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_checkpoints_equal_the_prefix_alone(offset_dtype):
    gen = torch.Generator().manual_seed(50)
    lens = [7, 0, 12, 1, 5]
    inp = make_inputs(lens, H=H, D=D, generator=gen)
    offsets = torch.tensor([[0, 3, 7], [0, 0, 0], [5, 5, 11], [1, 1, 1], [2, 4, 5]], dtype=offset_dtype)
    out, fs, ckpt = prefill_with_checkpoints(inp, offsets)
    cu = inp["cu_seqlens"].tolist()
    for n in range(len(lens)):
        for j in range(offsets.shape[1]):
            off = int(offsets[n, j])
            sub = {name: inp[name][:, cu[n]:cu[n] + off] for name in ("q", "k", "v", "g", "beta")}
            fs_alone = torch.empty(1, H, D, D)
            flashkda.prefill(**sub, **gate_kwargs(inp), initial_state=inp["initial_state"][n:n + 1],
                             final_state=fs_alone)
            assert torch.equal(ckpt[n, j], fs_alone[0]), (n, j)  # bit for bit
            _, ref = R.prefill(**sub, **gate_kwargs(inp), initial_state=inp["initial_state"][n:n + 1])
            assert rel_err(ckpt[n, j], ref[0]) < 1e-5
    # checkpoints change nothing else
    out2 = torch.full_like(out, SENTINEL)
    fs2 = torch.full_like(fs, SENTINEL)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out2, **gate_kwargs(inp),
                     initial_state=inp["initial_state"], final_state=fs2, cu_seqlens=inp["cu_seqlens"])
    assert torch.equal(out, out2) and torch.equal(fs, fs2)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_with_state_pool(state_dtype):
    gen = torch.Generator().manual_seed(51)
    inp = make_inputs([4, 3, 6], H=H, D=D, with_initial_state=False, generator=gen)
    pool = new_pool(5, state_dtype, gen)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0])
    has = torch.tensor([True, True, False])
    offsets = torch.tensor([[0, 2, 4], [1, 2, 3], [0, 1, 6]])
    out, _, ckpt = prefill_with_checkpoints(inp, offsets, initial_state=pool, final_state=pool, state_indices=idx,
                                            has_initial_state=has)
    assert torch.equal(ckpt[0, 0], before[3].float())  # offset 0: the starting state
    assert torch.all(ckpt[1] == SENTINEL)  # padded sequence: untouched
    assert torch.count_nonzero(ckpt[2, 0]) == 0  # has_initial_state False: zeros
    assert rel_err(pool[0], ckpt[2, 2]) < STATE_TOL[state_dtype]  # the last offset is the final state
    _, ref = R.prefill(inp["q"][:, 7:8], inp["k"][:, 7:8], inp["v"][:, 7:8], inp["g"][:, 7:8], inp["beta"][:, 7:8],
                       **gate_kwargs(inp))
    assert rel_err(ckpt[2, 1], ref[0]) < 1e-5


def test_opcheck_prefill_checkpoints():
    gen = torch.Generator().manual_seed(52)
    inp = make_inputs([4, 5], H=H, D=D, generator=gen)
    out = torch.empty(inp["v"].shape, dtype=BF16)
    kw = gate_kwargs(inp)
    kw.update(initial_state=inp["initial_state"], final_state=torch.empty(2, H, D, D), cu_seqlens=inp["cu_seqlens"],
              checkpoint_offsets=torch.tensor([[1, 4], [0, 3]]), checkpoint_state=torch.empty(2, 2, H, D, D))
    torch.library.opcheck(torch.ops.flashkda.prefill.default,
                          (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out,
                           torch.empty(0, dtype=torch.uint8)), kw)


CKPT_CASES = [
    ("offset_above_len", dict(checkpoint_offsets=torch.tensor([[0, 5], [2, 6]])), "checkpoint_offsets"),
    ("offset_decreasing", dict(checkpoint_offsets=torch.tensor([[0, 4], [3, 2]])), "checkpoint_offsets"),
    ("offset_negative", dict(checkpoint_offsets=torch.tensor([[-1, 4], [2, 6]])), "checkpoint_offsets"),
    ("offset_dtype", dict(checkpoint_offsets=torch.tensor([[0.0, 4.0], [2.0, 6.0]])), "checkpoint_offsets"),
    ("offset_rows", dict(checkpoint_offsets=torch.tensor([[0, 4]])), "checkpoint_offsets"),
    ("offsets_missing", dict(checkpoint_offsets=None), "checkpoint_offsets"),
    ("state_missing", dict(checkpoint_state=None), "checkpoint_state"),
    ("state_bf16", dict(checkpoint_state=torch.full((2, 2, H, D, D), SENTINEL, dtype=BF16)), "checkpoint_state"),
    ("state_shape", dict(checkpoint_state=torch.full((2, 3, H, D, D), SENTINEL)), "checkpoint_state"),
]


@pytest.mark.parametrize("change,arg", [c[1:] for c in CKPT_CASES], ids=[c[0] for c in CKPT_CASES])
def test_checkpoint_bad_input(change, arg):
    gen = torch.Generator().manual_seed(53)
    inp = make_inputs([4, 6], H=H, D=D, generator=gen)
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    fs = torch.full((2, H, D, D), SENTINEL)
    kw = dict(checkpoint_offsets=torch.tensor([[0, 4], [2, 6]]), checkpoint_state=torch.full((2, 2, H, D, D), SENTINEL))
    kw.update(change)
    written = [t for t in (out, fs, kw["checkpoint_state"]) if t is not None]
    before = [t.clone() for t in written]
    with pytest.raises(ValueError) as info:
        flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **gate_kwargs(inp),
                         initial_state=inp["initial_state"], final_state=fs, cu_seqlens=inp["cu_seqlens"], **kw)
    assert f"flashkda: argument '{arg}': expected " in str(info.value), str(info.value)
    for t, b in zip(written, before):
        assert torch.equal(t, b)


def test_checkpoint_state_overlapping_initial_state_is_refused():
    gen = torch.Generator().manual_seed(54)
    inp = make_inputs([4, 6], H=H, D=D, generator=gen)
    buf = torch.full((2, 2, H, D, D), SENTINEL)  # checkpoint_state; its first row is also initial_state
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    fs = torch.full((2, H, D, D), SENTINEL)
    with pytest.raises(ValueError, match=r"^flashkda: argument 'checkpoint_state': expected no memory shared with "
                                         r"initial_state, got an overlap$"):
        flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **gate_kwargs(inp),
                         initial_state=buf[0], final_state=fs, cu_seqlens=inp["cu_seqlens"],
                         checkpoint_offsets=torch.tensor([[0, 4], [2, 6]]), checkpoint_state=buf)
    assert torch.all(buf == SENTINEL) and torch.all(out == SENTINEL) and torch.all(fs == SENTINEL)


# ---------------------------------------------------------------------------------------------
# A serving simulation: 200 steps of prefills, continuations, plain and speculative decode on one pool

def test_serving_simulation():
    """pool_simulation.run_pool_simulation on the CPU reference path (fixed seed)."""
    run_pool_simulation(gen=torch.Generator().manual_seed(2024), rng=random.Random(2024), device="cpu",
                        state_dtype=torch.float32, H=H, D=D, P=40, new_len=16, cont_len=9, out_tol=OUT_TOL,
                        state_tol=1e-5, out_fill=SENTINEL, decode_op=op_decode, seed=2024)
