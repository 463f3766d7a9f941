"""torch.ops.flashkda.{fwd,prefill} on CPU against the float64 pure-PyTorch reference."""

import itertools

import pytest
import torch

import flashkda
from kda_helpers import BF16, SENTINEL, cu_from_lens, make_inputs, new_outputs, op_kwargs, reference, rel_err

OUT_TOL = 1e-2  # out is bf16: one rounding gives ~2e-3
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENS = [0, 1, 17, 40, 0, 3]


def run_prefill(inp, **extra):
    out, fs = new_outputs(inp, P=extra.pop("P", None))
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **op_kwargs(inp),
                     final_state=fs, **extra)
    return out, fs


def check(inp, out, fs, ref_out, ref_fs):
    assert rel_err(out, ref_out) < OUT_TOL
    assert rel_err(fs, ref_fs) < STATE_TOL[fs.dtype]


@pytest.mark.parametrize("gate_mode,use_qk_l2norm,use_beta_sigmoid",
                         list(itertools.product(["bounded", "softplus", "precomputed"], [True, False],
                                                [True, False])))
def test_modes_varlen(gate_mode, use_qk_l2norm, use_beta_sigmoid):
    gen = torch.Generator().manual_seed(hash((gate_mode, use_qk_l2norm, use_beta_sigmoid)) % 2**31)
    inp = make_inputs(LENS, H=2, D=64, gate_mode=gate_mode, use_qk_l2norm=use_qk_l2norm,
                      use_beta_sigmoid=use_beta_sigmoid, generator=gen)
    out, fs = run_prefill(inp)
    ref_out, ref_fs = reference(inp)
    check(inp, out, fs, ref_out, ref_fs)
    # zero-length sequences: final state == initial state
    for n, length in enumerate(LENS):
        if length == 0:
            torch.testing.assert_close(fs[n], inp["initial_state"][n], rtol=0, atol=0)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_head_dims_and_state_dtypes(D, state_dtype):
    gen = torch.Generator().manual_seed(D + (0 if state_dtype == torch.float32 else 1))
    inp = make_inputs([5, 33, 1], H=3, D=D, state_dtype=state_dtype, generator=gen)
    out, fs = run_prefill(inp)
    check(inp, out, fs, *reference(inp))


def test_fwd_matches_prefill_and_reference():
    gen = torch.Generator().manual_seed(1)
    inp = make_inputs([300, 17, 64, 131], H=4, D=128, generator=gen)
    out, fs = new_outputs(inp)
    ret = flashkda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out=out, A_log=inp["A_log"],
                       dt_bias=inp["dt_bias"], initial_state=inp["initial_state"], final_state=fs,
                       cu_seqlens=inp["cu_seqlens"])
    assert ret is out
    ref_out, ref_fs = reference(inp)
    assert rel_err(out, ref_out) < 4e-3  # the spec's required bound holds for the exact reference too
    assert rel_err(fs, ref_fs) < 1e-6
    out2, fs2 = run_prefill(inp)
    assert torch.equal(out, out2) and torch.equal(fs, fs2)


def test_fwd_op_direct_call():
    gen = torch.Generator().manual_seed(2)
    inp = make_inputs([7, 9], H=2, D=64, generator=gen)
    out, fs = new_outputs(inp)
    ws = torch.empty(0, dtype=torch.uint8)
    torch.ops.flashkda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 64 ** -0.5, out, ws,
                           inp["A_log"], inp["dt_bias"], -5.0, inp["initial_state"], fs, inp["cu_seqlens"])
    check(inp, out, fs, *reference(inp))


@pytest.mark.parametrize("with_state", [True, False])
def test_fixed_length_batch(with_state):
    gen = torch.Generator().manual_seed(3)
    inp = make_inputs(None, B=3, T=23, H=2, D=64, with_initial_state=with_state, generator=gen)
    out, fs = run_prefill(inp)
    check(inp, out, fs, *reference(inp))


def test_without_final_state_and_scale():
    gen = torch.Generator().manual_seed(4)
    inp = make_inputs([12, 20], H=2, D=64, generator=gen)
    out = flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=0.3, **op_kwargs(inp))
    ref_out, _ = reference(inp, scale=0.3)
    assert rel_err(out, ref_out) < OUT_TOL


def test_no_initial_state_means_zeros():
    gen = torch.Generator().manual_seed(5)
    inp = make_inputs([10, 0, 4], H=2, D=64, with_initial_state=False, generator=gen)
    out, fs = run_prefill(inp)
    check(inp, out, fs, *reference(inp))
    assert torch.count_nonzero(fs[1]) == 0  # empty sequence, no initial state


def test_all_empty():
    gen = torch.Generator().manual_seed(6)
    inp = make_inputs([0, 0], H=2, D=64, generator=gen)
    out, fs = run_prefill(inp)
    assert out.numel() == 0
    assert torch.equal(fs, inp["initial_state"])


def test_in_place_state():
    gen = torch.Generator().manual_seed(7)
    inp = make_inputs([9, 0, 31], H=2, D=64, generator=gen)
    ref_out, ref_fs = reference(inp)
    state = inp["initial_state"].clone()
    inp["initial_state"] = state
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **op_kwargs(inp), final_state=state)
    assert rel_err(out, ref_out) < OUT_TOL
    assert rel_err(state, ref_fs) < 1e-5


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("g_dtype,beta_dtype", [(BF16, BF16), (torch.float32, torch.float32)])
def test_index_and_gate_dtypes(cu_dtype, g_dtype, beta_dtype):
    gen = torch.Generator().manual_seed(8)
    inp = make_inputs([4, 19], H=2, D=64, cu_dtype=cu_dtype, g_dtype=g_dtype, beta_dtype=beta_dtype, generator=gen)
    out, fs = run_prefill(inp)
    check(inp, out, fs, *reference(inp))


@pytest.mark.parametrize("varlen", [True, False])
def test_row_strided_inputs(varlen):
    gen = torch.Generator().manual_seed(9)
    if varlen:
        inp = make_inputs([6, 1, 25], H=3, D=64, strided=True, generator=gen)
    else:
        inp = make_inputs(None, B=2, T=14, H=3, D=64, strided=True, generator=gen)
    assert not inp["q"].is_contiguous() and inp["q"].stride(1) > 3 * 64
    assert inp["beta"].stride(1) > 3
    out, fs = run_prefill(inp)
    check(inp, out, fs, *reference(inp))
    # same bits as contiguous copies
    dense = dict(inp)
    for name in ("q", "k", "v", "g", "beta"):
        dense[name] = inp[name].contiguous()
    out2, fs2 = run_prefill(dense)
    assert torch.equal(out, out2) and torch.equal(fs, fs2)


def test_strided_out():
    gen = torch.Generator().manual_seed(10)
    inp = make_inputs([5, 8], H=2, D=64, generator=gen)
    buf = torch.full((1, 13, 2 * 64 + 32), SENTINEL, dtype=BF16)
    out = buf[:, :, 16:16 + 128].unflatten(2, (2, 64))
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **op_kwargs(inp))
    ref_out, _ = reference(inp)
    assert rel_err(out, ref_out) < OUT_TOL
    assert torch.all(buf[:, :, :16] == SENTINEL) and torch.all(buf[:, :, 16 + 128:] == SENTINEL)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_pool(in_place, state_dtype):
    gen = torch.Generator().manual_seed(11)
    lens = [6, 3, 0, 14, 5]
    inp = make_inputs(lens, H=2, D=64, state_dtype=state_dtype, with_initial_state=False, generator=gen)
    P = 8
    pool = (0.1 * torch.randn(P, 2, 64, 64, generator=gen)).to(state_dtype)
    idx = torch.tensor([5, -1, 0, 3, 6], dtype=torch.int32)
    has = torch.tensor([True, True, True, False, True])
    inp["initial_state"] = pool
    ref_out, ref_final = reference(inp, state_indices=idx, has_initial_state=has)
    ref_pool = flashkda.reference.update_state_pool(pool, ref_final, idx)
    if in_place:
        fs = pool.clone()
        inp["initial_state"] = fs
    else:
        fs = torch.full_like(pool, SENTINEL)
    out = torch.full(inp["v"].shape, SENTINEL, dtype=BF16)
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **op_kwargs(inp), final_state=fs,
                     state_indices=idx, has_initial_state=has)
    assert rel_err(out, ref_out) < OUT_TOL
    # padded sequence 1 (tokens 6..8): output zeroed
    assert torch.count_nonzero(out[0, 6:9]) == 0
    used = [5, 0, 3, 6]
    assert rel_err(fs[used], ref_pool[used]) < STATE_TOL[state_dtype]
    untouched = [r for r in range(P) if r not in used]
    expect_untouched = pool[untouched] if in_place else torch.full_like(pool[untouched], SENTINEL)
    assert torch.equal(fs[untouched], expect_untouched)


def test_has_initial_state_without_pool():
    gen = torch.Generator().manual_seed(12)
    inp = make_inputs([4, 7, 2], H=2, D=64, generator=gen)
    has = torch.tensor([False, True, False])
    out, fs = run_prefill(inp, has_initial_state=has)
    check(inp, out, fs, *reference(inp, has_initial_state=has))


def test_reference_self_consistency():
    """The float64 reference: varlen == per-sequence fixed-length runs; empty sequence keeps h0."""
    gen = torch.Generator().manual_seed(13)
    lens = [3, 0, 8]
    inp = make_inputs(lens, H=2, D=64, generator=gen)
    out, fin = reference(inp)
    cu = cu_from_lens(lens).tolist()
    for n, length in enumerate(lens):
        sub = dict(inp)
        for name in ("q", "k", "v", "g", "beta"):
            sub[name] = inp[name][:, cu[n]:cu[n + 1]]
        sub["initial_state"] = inp["initial_state"][n:n + 1]
        sub["cu_seqlens"] = None
        o1, f1 = reference(sub)
        torch.testing.assert_close(o1, out[:, cu[n]:cu[n + 1]], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f1[0], fin[n], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin[1], inp["initial_state"][1].double(), rtol=0, atol=0)


def test_scale_rule_of_the_reference_and_the_ops():
    """None or 0: K^-0.5; a negative or non-finite scale: ValueError naming it, in the op's words (the
    reference used to replace a negative one by K^-0.5 silently)."""
    gen = torch.Generator().manual_seed(14)
    inp = make_inputs([3, 4], H=2, D=64, generator=gen)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    for bad in (-0.5, float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^flashkda: argument 'scale': expected a finite value > 0, or 0 for "
                                             r"K\^-0\.5, got ") as op_error:
            flashkda.prefill(*args, scale=bad, **op_kwargs(inp))
        with pytest.raises(ValueError) as ref_error:
            reference(inp, scale=bad)
        assert str(ref_error.value) == str(op_error.value)
        pool = torch.zeros(4, 2, 64, 64)
        with pytest.raises(ValueError, match="argument 'scale'"):
            flashkda.reference.decode(*args, pool, torch.tensor([0, 1]), cu_seqlens=inp["cu_seqlens"], scale=bad,
                                      A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    out0, _ = reference(inp, scale=0.0)
    out_default, _ = reference(inp)
    assert torch.equal(out0, out_default)
    assert torch.equal(flashkda.prefill(*args, scale=0.0, **op_kwargs(inp)), flashkda.prefill(*args, **op_kwargs(inp)))


def test_device_error_names():
    assert flashkda.DEVICE_ERRORS[6] == (
        "two sequences share a state_indices row (prefill), or ssm_state_indices writes a pool row twice, or a row "
        "one request writes is read by another (decode)")
    assert sorted(flashkda.DEVICE_ERRORS) == list(range(7))
