"""flashkda.chunk_kda: fla-compatible signature and semantics, both state layouts."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import flashkda
from flashkda import reference as R
from kda_helpers import BF16, make_inputs, rel_err

# fla 0.6.0's chunk_kda positional parameters, in order.
FLA_PARAMS = [
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "cp_context", "use_graph", "max_num_seqs",
]
KIMI = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=-5.0)


def k_first(state):
    return state.transpose(-1, -2).contiguous()


def test_signature_is_fla_compatible():
    params = list(inspect.signature(flashkda.chunk_kda).parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLA_PARAMS
    names = {p.name for p in params}
    assert {"A_log", "dt_bias"} <= names
    assert params[-1].kind == inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("varlen", [True, False])
def test_kimi_config_matches_fwd_in_both_layouts(varlen):
    gen = torch.Generator().manual_seed(20)
    if varlen:
        inp = make_inputs([0, 1, 30, 17], H=2, D=64, generator=gen)
    else:
        inp = make_inputs(None, B=2, T=21, H=2, D=64, generator=gen)
    h0 = inp["initial_state"]  # V-first
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    fs = torch.empty_like(h0)
    out = flashkda.fwd(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], initial_state=h0, final_state=fs,
                       cu_seqlens=inp["cu_seqlens"])

    o_vf, ht_vf = flashkda.chunk_kda(*args, initial_state=h0, output_final_state=True, state_v_first=True,
                                     cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"],
                                     dt_bias=inp["dt_bias"].flatten(), **KIMI)
    o_kf, ht_kf = flashkda.chunk_kda(*args, initial_state=k_first(h0), output_final_state=True,
                                     cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"],
                                     dt_bias=inp["dt_bias"].flatten(), **KIMI)
    assert torch.equal(o_vf, out) and torch.equal(o_kf, out)
    assert torch.equal(ht_vf, fs)
    assert ht_kf.shape == (inp["N"], 2, 64, 64) and ht_kf.is_contiguous()
    assert torch.equal(ht_kf, k_first(fs))
    ref_out, ref_fs = R.prefill(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], initial_state=h0,
                                cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o_kf, ref_out) < 1e-2
    assert rel_err(ht_kf, k_first(ref_fs)) < 1e-5


def _ref(inp, **kw):
    return R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu_seqlens"], **kw)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_precomputed_gate_default_flags(state_v_first):
    """fla's defaults: g is the log decay; q, k, beta used as given."""
    gen = torch.Generator().manual_seed(21)
    inp = make_inputs([13, 5], H=2, D=64, gate_mode="precomputed", use_qk_l2norm=False, use_beta_sigmoid=False,
                      generator=gen)
    h0 = inp["initial_state"]
    o, ht = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                               initial_state=h0 if state_v_first else k_first(h0), output_final_state=True,
                               state_v_first=state_v_first, cu_seqlens=inp["cu_seqlens"])
    ref_out, ref_fs = _ref(inp, gate_mode="precomputed", use_qk_l2norm=False, use_beta_sigmoid=False,
                           initial_state=h0)
    assert rel_err(o, ref_out) < 1e-2
    assert rel_err(ht, ref_fs if state_v_first else k_first(ref_fs)) < 1e-5


def test_softplus_gate_when_no_lower_bound():
    gen = torch.Generator().manual_seed(22)
    inp = make_inputs([9, 16], H=2, D=64, gate_mode="softplus", generator=gen)
    o, ht = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                               initial_state=k_first(inp["initial_state"]), output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, cu_seqlens=inp["cu_seqlens"],
                               A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten())
    ref_out, ref_fs = _ref(inp, gate_mode="softplus", A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                           initial_state=inp["initial_state"])
    assert rel_err(o, ref_out) < 1e-2
    assert rel_err(ht, k_first(ref_fs)) < 1e-5


def test_bounded_gate_without_A_log_and_dt_bias():
    """fla: with lower_bound and A_log=None the gate is lower_bound * sigmoid(g + dt_bias); no dt_bias = 0."""
    gen = torch.Generator().manual_seed(23)
    inp = make_inputs([11], H=2, D=64, generator=gen)
    o, ht = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=-3.0, cu_seqlens=inp["cu_seqlens"])
    ref_out, ref_fs = _ref(inp, gate_mode="bounded", A_log=torch.zeros(2), dt_bias=torch.zeros(2, 64),
                           lower_bound=-3.0)
    assert rel_err(o, ref_out) < 1e-2
    assert rel_err(ht, k_first(ref_fs)) < 1e-5


def test_allow_neg_eigval():
    gen = torch.Generator().manual_seed(24)
    inp = make_inputs([10, 3], H=2, D=64, generator=gen)
    o, _ = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu_seqlens"],
                              A_log=inp["A_log"], dt_bias=inp["dt_bias"], allow_neg_eigval=True, **KIMI)
    beta2 = 2 * torch.sigmoid(inp["beta"].double())
    ref_out, _ = R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], beta2, A_log=inp["A_log"],
                           dt_bias=inp["dt_bias"], use_beta_sigmoid=False, cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o, ref_out) < 1e-2


def test_no_final_state_and_strided_inputs():
    gen = torch.Generator().manual_seed(25)
    inp = make_inputs(None, B=2, T=9, H=2, D=64, strided=True, generator=gen)
    o, ht = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                               dt_bias=inp["dt_bias"], **KIMI)
    assert ht is None and o.dtype == BF16 and o.shape == inp["v"].shape
    ref_out, _ = _ref(inp, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    assert rel_err(o, ref_out) < 1e-2
    # a [H, D] block that is not contiguous is copied by the wrapper
    qt = inp["q"].transpose(2, 3).contiguous().transpose(2, 3)
    o2, _ = flashkda.chunk_kda(qt, inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                               dt_bias=inp["dt_bias"], **KIMI)
    assert torch.equal(o, o2)


def test_deprecated_transpose_state_layout_and_chunk_size():
    gen = torch.Generator().manual_seed(26)
    inp = make_inputs([7], H=2, D=64, generator=gen)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"],
              A_log=inp["A_log"], dt_bias=inp["dt_bias"], **KIMI)
    o1, h1 = flashkda.chunk_kda(*args, state_v_first=True, **kw)
    with pytest.warns(DeprecationWarning):
        o2, h2 = flashkda.chunk_kda(*args, transpose_state_layout=True, chunk_size=32, disable_recompute=True,
                                    cu_seqlens_cpu=inp["cu_seqlens"].cpu(), max_num_seqs=1, **kw)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    with pytest.raises(ValueError, match="chunk_size"):
        flashkda.chunk_kda(*args, chunk_size=48, **kw)


@pytest.mark.parametrize("case", ["unknown_kwarg", "gva", "fp16", "intermediate", "cp", "head_dim",
                                  "grad", "use_graph", "padded_tokens"])
def test_not_implemented(case):
    gen = torch.Generator().manual_seed(27)
    inp = make_inputs([5, 4], H=2, D=64, generator=gen)
    args = [inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]]
    kw = dict(cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"], **KIMI)
    match = None
    if case == "unknown_kwarg":
        kw["head_first"] = True
        match = "head_first"
    elif case == "gva":
        args[2] = torch.randn(1, 9, 4, 64).to(BF16)
        match = "'v'"
    elif case == "fp16":
        args[0] = args[0].half()
        match = "'q'"
    elif case == "intermediate":
        kw["return_intermediate_states"] = True
        match = "return_intermediate_states"
    elif case == "cp":
        kw["cp_context"] = object()
        match = "cp_context"
    elif case == "head_dim":
        args = [torch.randn(1, 9, 2, 96).to(BF16) for _ in range(4)] + [args[4]]
        kw["dt_bias"] = torch.zeros(2, 96)
        match = "head dim"
    elif case == "grad":
        args[0] = args[0].clone().requires_grad_(True)
        match = "backward is not implemented"
    elif case == "use_graph":  # fla's padded mode: cu_seqlens may end before the last token
        kw.update(use_graph=True, max_num_seqs=2)
        match = "use_graph"
    elif case == "padded_tokens":  # a host copy of cu_seqlens that ends before q's last token
        kw["cu_seqlens_cpu"] = torch.tensor([0, 5, 7], dtype=torch.int32)
        match = r"cu_seqlens_cpu ends at 7, not at the 9 tokens of q"
    with pytest.raises(NotImplementedError, match=match):
        flashkda.chunk_kda(*args, **kw)


def test_value_errors_like_fla():
    gen = torch.Generator().manual_seed(28)
    inp = make_inputs(None, B=2, T=5, H=2, D=64, generator=gen)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    with pytest.raises(ValueError, match="batch size must be 1"):
        flashkda.chunk_kda(*args, cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        flashkda.chunk_kda(*args, initial_state=torch.zeros(3, 2, 64, 64))
    with pytest.raises(ValueError, match="A_log"):
        flashkda.chunk_kda(*args, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="lower_bound"):
        flashkda.chunk_kda(*args, use_gate_in_kernel=True, safe_gate=True, A_log=inp["A_log"])
    with pytest.raises(ValueError, match="lower_bound"):
        flashkda.chunk_kda(*args, use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        flashkda.chunk_kda(*args, allow_neg_eigval=True)


def test_inference_mode_and_no_grad_ok():
    gen = torch.Generator().manual_seed(29)
    inp = make_inputs([4], H=2, D=64, gate_mode="precomputed", use_qk_l2norm=False, use_beta_sigmoid=False,
                      generator=gen)
    q = inp["q"].clone().requires_grad_(True)
    with torch.no_grad():
        o1, _ = flashkda.chunk_kda(q, inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu_seqlens"])
    with torch.inference_mode():
        o2, _ = flashkda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                   cu_seqlens=inp["cu_seqlens"])
    assert torch.equal(o1, o2)
    ref = F.normalize(inp["q"].float(), dim=-1)  # (sanity: inputs were pre-normalised)
    assert torch.allclose(ref, inp["q"].float(), atol=1e-2)


def _kimi_args(seed, lens=(3, 5)):
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(list(lens), H=2, D=64, generator=gen)
    args = [inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]]
    kw = dict(cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), **KIMI)
    return inp, args, kw


# (id, change of (args, kw), the message): a wrong type or rank named before anything reads it
TYPE_RANK_CASES = [
    ("cu_seqlens_0d", lambda a, kw: kw.update(cu_seqlens=torch.tensor(0, dtype=torch.int32)),
     r"argument 'cu_seqlens': expected rank 1 \[N\+1\], got rank 0 \[\]$"),
    ("cu_seqlens_empty", lambda a, kw: kw.update(cu_seqlens=torch.zeros(0, dtype=torch.int32), output_final_state=True),
     r"argument 'cu_seqlens': expected at least 1 element \[N\+1\], got \[0\]$"),
    ("cu_seqlens_2d",
     lambda a, kw: kw.update(cu_seqlens=kw["cu_seqlens"][None], initial_state=torch.zeros(2, 2, 64, 64)),
     r"argument 'cu_seqlens': expected rank 1 \[N\+1\], got rank 2 \[1, 3\]$"),
    ("cu_seqlens_list", lambda a, kw: kw.update(cu_seqlens=[0, 3, 8]),
     r"argument 'cu_seqlens': expected a tensor \[N\+1\], got list$"),
    ("initial_state_0d", lambda a, kw: kw.update(initial_state=torch.tensor(1.0)),
     r"argument 'initial_state': expected rank 4 \[N, H, K, V\], got rank 0 \[\]$"),
    ("initial_state_3d_v_first", lambda a, kw: kw.update(initial_state=torch.zeros(2, 64, 64), state_v_first=True),
     r"argument 'initial_state': expected rank 4 \[N, H, V, K\], got rank 3 \[2, 64, 64\]$"),
    ("initial_state_heads", lambda a, kw: kw.update(initial_state=torch.zeros(2, 3, 64, 64)),
     r"argument 'initial_state': expected shape \[2, 2, 64, 64\] \(N, H, K, V\): one state per sequence, "
     r"got \[2, 3, 64, 64\]$"),
    ("A_log_list", lambda a, kw: kw.update(A_log=[0.0, 0.0]),
     r"argument 'A_log': expected a tensor \[H\] or None, got list$"),
    ("dt_bias_float", lambda a, kw: kw.update(dt_bias=0.5),
     r"argument 'dt_bias': expected a tensor \[H \* K\] or None, got float$"),
    ("q_list", lambda a, kw: a.__setitem__(0, [[0.0]]), r"argument 'q': expected a tensor \[B, T, H, K\], got list$"),
    ("q_3d", lambda a, kw: a.__setitem__(0, a[0][0]),
     r"argument 'q': expected rank 4 \[B, T, H, K\], got rank 3 \[8, 2, 64\]$"),
    ("v_5d", lambda a, kw: a.__setitem__(2, a[2][None]), r"argument 'v': expected rank 4 \[B, T, H, V\], got rank 5"),
]


@pytest.mark.parametrize("change,match", [c[1:] for c in TYPE_RANK_CASES], ids=[c[0] for c in TYPE_RANK_CASES])
def test_argument_types_and_ranks(change, match):
    _, args, kw = _kimi_args(30)
    change(args, kw)
    with pytest.raises(ValueError, match="^flashkda: " + match):
        flashkda.chunk_kda(*args, **kw)


def test_state_v_first_with_transpose_state_layout():
    inp, args, kw = _kimi_args(31)
    with pytest.raises(ValueError, match=r"pass either 'state_v_first' or the deprecated 'transpose_state_layout', "
                                         "not both"):
        flashkda.chunk_kda(*args, initial_state=inp["initial_state"], state_v_first=True,
                           transpose_state_layout=True, **kw)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_scale_must_be_positive_or_none(scale):
    """fla multiplies by the scale it is given (0: a zero q-scale); the ops read 0 as K^-0.5 and refuse a
    negative one.  chunk_kda, fla's drop-in, takes only what both read alike: None or a positive scale."""
    _, args, kw = _kimi_args(32)
    with pytest.raises(ValueError, match=r"^flashkda: argument 'scale': expected None \(K\^-0\.5\) or a finite value "
                                         r"> 0 \(fla's chunk_kda would use it as given; flashkda supports only "
                                         r"positive scales or None\), got "):
        flashkda.chunk_kda(*args, scale=scale, **kw)
    o_none, _ = flashkda.chunk_kda(*args, **kw)
    o_pos, _ = flashkda.chunk_kda(*args, scale=64 ** -0.5, **kw)
    assert torch.equal(o_none, o_pos)
