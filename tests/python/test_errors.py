"""Bad inputs: ValueError / NotImplementedError naming the argument, and nothing written."""

import re

import pytest
import torch

import flashkda
from kda_helpers import BF16, SENTINEL, make_inputs

H, D = 2, 64
LENS = [3, 5]
T = sum(LENS)


def base():
    gen = torch.Generator().manual_seed(40)
    inp = make_inputs(LENS, H=H, D=D, generator=gen)
    out = torch.full((1, T, H, D), SENTINEL, dtype=BF16)
    fs = torch.full((2, H, D, D), SENTINEL, dtype=torch.float32)
    kw = dict(gate_mode="bounded", A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=-5.0,
              initial_state=inp["initial_state"], final_state=fs, cu_seqlens=inp["cu_seqlens"])
    args = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], out=out)
    return args, kw


def bf(*shape):
    return torch.randn(*shape).to(BF16)


def set_args(**new):
    def f(a, kw):
        a.update(new)
    return f


def set_kw(**new):
    def f(a, kw):
        kw.update(new)
    return f


def wider(x):
    """x with a non-contiguous last dim."""
    buf = torch.zeros(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype)
    view = buf[..., ::2]
    view.copy_(x)
    return view


def overlapping_state(a, kw):
    buf = torch.zeros(2 * H * D * D + 10)
    kw["initial_state"] = buf[:2 * H * D * D].view(2, H, D, D)
    kw["final_state"] = buf[10:10 + 2 * H * D * D].view(2, H, D, D)


def out_in_final_state(a, kw):
    """out made of final_state's first bytes (final_state is poisoned too: nothing may be written)."""
    a["out"] = kw["final_state"].view(-1).view(BF16)[:T * H * D].view(1, T, H, D)


def state_pool(indices, P=4, has=None):
    def f(a, kw):
        kw["initial_state"] = torch.zeros(P, H, D, D)
        kw["final_state"] = torch.full((P, H, D, D), SENTINEL)
        kw["state_indices"] = indices
        if has is not None:
            kw["has_initial_state"] = has
    return f


# (id, mutation, exception, argument named in the message[, what the message must also say])
CASES = [
    ("q_dtype", set_args(q=torch.randn(1, T, H, D)), ValueError, "q"),
    ("q_rank", set_args(q=bf(T, H, D)), ValueError, "q"),
    ("q_rank6", set_args(q=bf(1, 1, T, H, D, 1)), ValueError, "q"),
    ("q_inner_not_contiguous", set_args(q=bf(1, T, D, H).transpose(2, 3)), ValueError, "q"),
    ("k_shape", set_args(k=bf(1, T + 1, H, D)), ValueError, "k",
     r"expected shape \[1, 8, 2, 64\] \(B, T, H, K of q\), got \[1, 9, 2, 64\]$"),
    # q one token longer than the rest: k is the first tensor that disagrees, and the label points at q.
    ("cu_seqlens_no_sequence", set_kw(cu_seqlens=torch.tensor([0], dtype=torch.int32)), ValueError, "cu_seqlens",
     r"expected at least 2 elements \[N\+1\] for T = 8 tokens, got \[1\]$"),
    ("q_longer_than_k", set_args(q=bf(1, T + 1, H, D)), ValueError, "k",
     r"expected shape \[1, 9, 2, 64\] \(B, T, H, K of q\), got \[1, 8, 2, 64\]$"),
    ("k_dtype", set_args(k=torch.randn(1, T, H, D).half()), ValueError, "k"),
    ("v_dtype", set_args(v=torch.randn(1, T, H, D)), ValueError, "v"),
    ("v_heads", set_args(v=bf(1, T, H + 1, D)), ValueError, "v"),
    ("head_dim_96", set_args(q=bf(1, T, H, 96), k=bf(1, T, H, 96), v=bf(1, T, H, 96)), NotImplementedError, "q"),
    ("head_dim_k_ne_v", set_args(v=bf(1, T, H, 128)), NotImplementedError, "v"),
    ("g_shape", set_args(g=bf(1, T, H, D // 2)), ValueError, "g"),
    ("g_dtype", set_args(g=torch.randn(1, T, H, D).half()), ValueError, "g"),
    ("beta_shape", set_args(beta=bf(1, T, H, 1)), ValueError, "beta"),
    ("beta_not_contiguous", set_args(beta=wider(bf(1, T, H))), ValueError, "beta"),
    ("out_dtype", set_args(out=torch.full((1, T, H, D), SENTINEL)), ValueError, "out"),
    ("out_shape", set_args(out=torch.full((1, T, H, D + 1), SENTINEL, dtype=BF16)), ValueError, "out",
     r"\(B, T, H of q, V of v\), got \[1, 8, 2, 65\]$"),
    ("out_overlapping_tokens",
     set_args(out=torch.full((1, 1, H, D), SENTINEL, dtype=BF16).expand(1, T, H, D)), ValueError, "out"),
    ("A_log_missing", set_kw(A_log=None), ValueError, "A_log"),
    ("A_log_shape", set_kw(A_log=torch.rand(H + 1)), ValueError, "A_log"),
    ("A_log_dtype", set_kw(A_log=torch.rand(H, dtype=torch.float64)), ValueError, "A_log"),
    ("dt_bias_missing_softplus", set_kw(gate_mode="softplus", dt_bias=None), ValueError, "dt_bias"),
    ("dt_bias_shape", set_kw(dt_bias=torch.rand(H, D + 1)), ValueError, "dt_bias"),
    ("dt_bias_bf16", set_kw(dt_bias=torch.rand(H, D).to(BF16)), ValueError, "dt_bias"),
    ("lower_bound_low", set_kw(lower_bound=-6.0), ValueError, "lower_bound"),
    ("lower_bound_zero", set_kw(lower_bound=0.0), ValueError, "lower_bound"),
    ("lower_bound_nan", set_kw(lower_bound=float("nan")), ValueError, "lower_bound"),
    ("scale_inf", set_kw(scale=float("inf")), ValueError, "scale"),
    ("gate_mode", set_kw(gate_mode="sigmoid"), ValueError, "gate_mode"),
    ("cu_first", set_kw(cu_seqlens=torch.tensor([1, 3, T], dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("cu_decreasing", set_kw(cu_seqlens=torch.tensor([0, 5, 3, T], dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("cu_last", set_kw(cu_seqlens=torch.tensor([0, 3, T - 1], dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("cu_dtype", set_kw(cu_seqlens=torch.tensor([0.0, 3.0, T])), ValueError, "cu_seqlens"),
    ("cu_rank", set_kw(cu_seqlens=torch.tensor([[0, 3, T]], dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("cu_batch", set_args(**{n: bf(2, T, H, D) for n in "qkvg"}, beta=bf(2, T, H),
                          out=torch.full((2, T, H, D), SENTINEL, dtype=BF16)), ValueError, "cu_seqlens"),
    ("initial_state_N", set_kw(initial_state=torch.zeros(3, H, D, D)), ValueError, "initial_state"),
    ("initial_state_dtype", set_kw(initial_state=torch.zeros(2, H, D, D).half()), ValueError, "initial_state"),
    ("initial_state_transposed", set_kw(initial_state=torch.zeros(2, H, D, D).transpose(-1, -2)), ValueError,
     "initial_state"),
    ("final_state_dtype", set_kw(final_state=torch.full((2, H, D, D), SENTINEL, dtype=BF16)), ValueError,
     "final_state"),
    ("final_state_shape", set_kw(final_state=torch.full((2, H, D, D + 1), SENTINEL)), ValueError, "final_state"),
    ("state_partial_overlap", overlapping_state, ValueError, "final_state"),
    ("state_index_range", state_pool(torch.tensor([0, 4], dtype=torch.int32)), ValueError, "state_indices"),
    ("state_index_duplicate", state_pool(torch.tensor([1, 1], dtype=torch.int32)), ValueError, "state_indices"),
    ("state_index_len", state_pool(torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "state_indices"),
    ("state_index_dtype", state_pool(torch.tensor([0.0, 1.0])), ValueError, "state_indices"),
    ("has_initial_state_dtype", set_kw(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)), ValueError,
     "has_initial_state"),
    ("has_initial_state_len", set_kw(has_initial_state=torch.tensor([True, False, True])), ValueError,
     "has_initial_state"),
    ("has_initial_state_without_initial_state",
     set_kw(initial_state=None, has_initial_state=torch.tensor([True, False])), ValueError, "has_initial_state",
     r"expected initial_state to be given with it \(.*\), got no initial_state$"),
    ("q_int16", set_args(q=torch.zeros(1, T, H, D, dtype=torch.int16)), ValueError, "q",
     r"expected dtype bfloat16, got int16$"),
    ("A_log_not_contiguous", set_kw(A_log=torch.rand(2 * H)[::2]), ValueError, "A_log",
     r"expected a contiguous tensor, got strides \[2\]$"),
    ("dt_bias_not_contiguous", set_kw(dt_bias=torch.rand(D, H).t()), ValueError, "dt_bias",
     r"expected a contiguous tensor, got strides \[1, 2\]$"),
    ("out_shares_final_state", out_in_final_state, ValueError, "out",
     r"expected no memory shared with final_state, got an overlap with final_state$"),
]


@pytest.mark.parametrize("mutate,exc,arg,match", [(c[1], c[2], c[3], c[4] if len(c) > 4 else "") for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input(mutate, exc, arg, match):
    a, kw = base()
    mutate(a, kw)
    out, fs = a["out"], kw["final_state"]
    out_before, fs_before = out.clone(), fs.clone() if fs is not None else None
    with pytest.raises(exc) as info:
        torch.ops.flashkda.prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], out,
                                   torch.empty(0, dtype=torch.uint8), **kw)
    msg = str(info.value)
    assert f"'{arg}'" in msg, msg
    assert msg.count("flashkda") >= 1
    assert re.search(match, msg), msg
    assert torch.equal(out, out_before)
    if fs is not None:
        assert torch.equal(fs, fs_before)


def test_case_count():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


def test_fwd_wrapper_requires_gate_params():
    a, kw = base()
    for missing in ("A_log", "dt_bias"):
        kws = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"])
        kws[missing] = None
        with pytest.raises(ValueError, match=f"'{missing}'"):
            flashkda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], out=a["out"], cu_seqlens=kw["cu_seqlens"], **kws)
    assert torch.all(a["out"] == SENTINEL)


def test_fwd_op_bad_input_leaves_outputs():
    a, kw = base()
    out, fs = a["out"], kw["final_state"]
    with pytest.raises(ValueError, match="'lower_bound'"):
        torch.ops.flashkda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], 0.125, out, torch.empty(0), kw["A_log"],
                               kw["dt_bias"], -10.0, kw["initial_state"], fs, kw["cu_seqlens"])
    assert torch.all(out == SENTINEL) and torch.all(fs == SENTINEL)


@pytest.mark.parametrize("mutate", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_prefill_check_says_what_prefill_says(mutate):
    """torch.ops.flashkda.prefill_check (the op's checks alone: kda_step validates every group with it
    before the first runs) raises the op's own error for every bad input, writing nothing."""
    a, kw = base()
    mutate(a, kw)
    out, fs = a["out"], kw["final_state"]
    out_before = out.clone()
    with pytest.raises(Exception) as run_err:
        torch.ops.flashkda.prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], out, torch.empty(0, dtype=torch.uint8),
                                   **kw)
    with pytest.raises(type(run_err.value)) as check_err:
        torch.ops.flashkda.prefill_check(a["q"], a["k"], a["v"], a["g"], a["beta"], out, **kw)
    assert str(check_err.value) == str(run_err.value)
    assert torch.equal(out, out_before)


def test_prefill_check_passes_valid_input_and_runs_nothing():
    a, kw = base()
    torch.ops.flashkda.prefill_check(a["q"], a["k"], a["v"], a["g"], a["beta"], a["out"], **kw)
    assert torch.all(a["out"] == SENTINEL) and torch.all(kw["final_state"] == SENTINEL)
