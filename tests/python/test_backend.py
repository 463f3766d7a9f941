"""Backend selection of flashkda.chunk_kda and flashkda.decode: backend=, FLASHKDA_BACKEND, explain(),
explain_decode(), the generic selector.

CPU-only: these run everywhere.  On a CPU tensor auto must pick the C++ reference, a backend asked
for by name must raise (never fall back) with the reason, and every error names why each backend
was rejected.
"""

import importlib

import pytest
import torch

import flashkda
import flashkda.backend as FB
import flashkda.chunk as FC
from flashkda import reference as R
from kda_helpers import BF16, make_inputs, rel_err

KIMI = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=-5.0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(FB.ENV_VAR, raising=False)
    FB._reset_caches()
    yield
    FB._reset_caches()


def _kimi_call(D=64, lens=(5, 0, 9), H=2, seed=40):
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(list(lens), H=H, D=D, generator=gen)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(initial_state=inp["initial_state"], output_final_state=True, state_v_first=True,
              cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), **KIMI)
    return inp, args, kw


def test_auto_picks_reference_for_cpu_tensors():
    _, args, kw = _kimi_call()
    sel = flashkda.explain(*args, **kw)
    assert isinstance(sel, flashkda.Selection)
    assert sel.backend == "reference" and sel.requested == "auto" and sel.source == "default"
    assert sel.reasons["reference"] is None
    o_auto, h_auto = flashkda.chunk_kda(*args, **kw)
    o_ref, h_ref = flashkda.chunk_kda(*args, backend="reference", **kw)
    o_arg, h_arg = flashkda.chunk_kda(*args, backend="AUTO", **kw)
    assert torch.equal(o_auto, o_ref) and torch.equal(h_auto, h_ref)
    assert torch.equal(o_auto, o_arg) and torch.equal(h_auto, h_arg)


def test_reference_backend_equals_the_op():
    inp, args, kw = _kimi_call(D=128, lens=(3, 17), seed=41)
    o, h = flashkda.chunk_kda(*args, backend="reference", **kw)
    fs = torch.empty_like(inp["initial_state"])
    out = flashkda.fwd(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], initial_state=inp["initial_state"],
                       final_state=fs, cu_seqlens=inp["cu_seqlens"])
    assert torch.equal(o, out) and torch.equal(h, fs)


def test_explicit_cuda_on_cpu_raises_with_the_reason():
    _, args, kw = _kimi_call()
    with pytest.raises(RuntimeError, match=r"backend 'cuda'.*cannot serve.*on cpu, not on a CUDA device") as ei:
        flashkda.chunk_kda(*args, backend="cuda", **kw)
    assert type(ei.value) is RuntimeError  # the machine, not a missing feature
    # an argument the kernels do not implement as well: NotImplementedError, both reasons given
    q16 = args[0].half()
    with pytest.raises(NotImplementedError, match=r"on cpu.*argument 'q': only bfloat16"):
        flashkda.chunk_kda(q16, *args[1:], backend="cuda", **kw)


def test_explicit_triton_on_cpu_raises():
    _, args, kw = _kimi_call()
    with pytest.raises(RuntimeError, match=r"backend 'triton'.*need CUDA tensors, got cpu"):
        flashkda.chunk_kda(*args, backend="triton", **kw)


def test_explain_says_why_cuda_and_triton_were_rejected():
    _, args, kw = _kimi_call()
    sel = flashkda.explain(*args, **kw)
    assert set(sel.reasons) == {"cuda", "triton", "reference"}  # every backend judged
    assert "not on a CUDA device" in sel.reasons["cuda"]
    assert "CUDA tensors" in sel.reasons["triton"]
    try:
        import fla.ops.kda  # noqa: F401
    except Exception:  # noqa: BLE001 (not installed, or no GPU support for triton)
        assert "fla" in sel.reasons["triton"]
    text = str(sel)
    assert "'reference'" in text and "selected" in text
    assert "cuda:" in text and "triton:" in text and text.count("rejected:") == 2
    assert sel.rejected.keys() == {"cuda", "triton"}


def test_env_var_selects_and_argument_wins(monkeypatch):
    _, args, kw = _kimi_call()
    o0, h0 = flashkda.chunk_kda(*args, **kw)
    monkeypatch.setenv(FB.ENV_VAR, " Reference ")
    sel = flashkda.explain(*args, **kw)
    assert sel.backend == "reference" and sel.requested == "reference" and sel.source == FB.ENV_VAR
    o1, h1 = flashkda.chunk_kda(*args, **kw)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)

    monkeypatch.setenv(FB.ENV_VAR, "cuda")  # replaces auto ...
    with pytest.raises(RuntimeError, match=r"backend 'cuda' \(asked for by environment variable FLASHKDA_BACKEND\)"):
        flashkda.chunk_kda(*args, **kw)
    with pytest.raises(RuntimeError, match="FLASHKDA_BACKEND"):
        flashkda.chunk_kda(*args, backend="auto", **kw)
    o2, _ = flashkda.chunk_kda(*args, backend="reference", **kw)  # ... but a backend named in the call wins
    assert torch.equal(o0, o2)
    assert flashkda.explain(*args, backend="reference", **kw).source == "argument"

    monkeypatch.setenv(FB.ENV_VAR, "auto")
    assert flashkda.explain(*args, **kw).backend == "reference"
    monkeypatch.setenv(FB.ENV_VAR, "")  # empty: unset
    assert flashkda.explain(*args, **kw).source == "default"


def test_invalid_backend_values(monkeypatch):
    _, args, kw = _kimi_call()
    monkeypatch.setenv(FB.ENV_VAR, "tensorrt")
    with pytest.raises(ValueError, match=r"environment variable FLASHKDA_BACKEND must be one of .*'tensorrt'"):
        flashkda.chunk_kda(*args, **kw)
    with pytest.raises(ValueError, match="FLASHKDA_BACKEND"):
        flashkda.explain(*args, **kw)
    monkeypatch.delenv(FB.ENV_VAR)
    with pytest.raises(ValueError, match=r"argument 'backend' must be one of .*'gpu'"):
        flashkda.chunk_kda(*args, backend="gpu", **kw)
    with pytest.raises(TypeError, match="backend"):
        flashkda.chunk_kda(*args, backend=1, **kw)


def test_unsupported_head_dim_error_explains_every_backend():
    gen = torch.Generator().manual_seed(42)
    q, k, v, g = (torch.randn(1, 9, 2, 96, generator=gen).to(BF16) for _ in range(4))
    beta = torch.randn(1, 9, 2, generator=gen).to(BF16)
    kw = dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32), A_log=torch.zeros(2),
              dt_bias=torch.zeros(2 * 96), **KIMI)
    with pytest.raises(NotImplementedError) as ei:
        flashkda.chunk_kda(q, k, v, g, beta, **kw)
    msg = str(ei.value)
    assert "no backend can serve this call" in msg
    for line in ("  cuda: ", "  triton: ", "  reference: "):
        assert line in msg
    assert "head dim K == V in {64, 128}, got K=96, V=96" in msg
    sel = flashkda.explain(q, k, v, g, beta, **kw)
    assert sel.backend is None and all(r is not None for r in sel.reasons.values())
    assert "no backend can serve this call" in str(sel)
    with pytest.raises(NotImplementedError, match="backend 'reference'.*head dim"):
        flashkda.chunk_kda(q, k, v, g, beta, backend="reference", **kw)


def test_grad_is_a_reason_not_a_fallback():
    _, args, kw = _kimi_call()
    q = args[0].clone().requires_grad_(True)
    sel = flashkda.explain(q, *args[1:], **kw)
    assert sel.backend is None and "argument 'q' requires grad" in sel.reasons["reference"]
    with pytest.raises(NotImplementedError, match="flashkda: backward is not implemented"):
        flashkda.chunk_kda(q, *args[1:], **kw)
    with torch.no_grad():
        assert flashkda.explain(q, *args[1:], **kw).backend == "reference"


def test_triton_passes_the_call_through(monkeypatch):
    """backend 'triton' hands every argument to fla's chunk_kda unchanged and returns its result."""
    _, args, kw = _kimi_call()
    seen = {}
    sentinel = (torch.zeros(1), None)

    def fake_fla_chunk_kda(*a, **k):
        seen["args"], seen["kwargs"] = a, k
        seen["self_call"] = FB.in_fla_self_call()  # flashkda's backend inside fla's dispatch declines it
        return sentinel

    def fake_select(kind, q, k, v, *, backend=None, fn=None, tensors=None, unsupported=(), evaluate_all=False):
        seen["unsupported"] = list(unsupported)
        return FB.Selection(kind=kind, fn=fn, backend="triton", requested="triton", source="argument",
                            device=q.device.type, reasons={"triton": None})

    monkeypatch.setattr(FC, "select_backend", fake_select)
    monkeypatch.setattr(FB, "fla_function", lambda kind: fake_fla_chunk_kda)
    ret = flashkda.chunk_kda(*args, backend="triton", chunk_size=32, head_first=False,
                             workspace=torch.empty(0, dtype=torch.uint8), **kw)
    assert ret is sentinel
    assert "workspace" not in seen["kwargs"]  # flashkda's own keyword, not fla's
    assert seen["self_call"] is True and FB.in_fla_self_call() is False
    assert all(a is b for a, b in zip(seen["args"], args)) and len(seen["args"]) == 5
    got = seen["kwargs"]
    for key, value in kw.items():
        assert got[key] is value or got[key] == value, key
    assert got["chunk_size"] == 32 and got["head_first"] is False and "backend" not in got
    assert got["return_intermediate_states"] is False and got["cp_context"] is None
    assert any("head_first" in r for r in seen["unsupported"])  # flashkda's own backends would refuse it


@pytest.mark.parametrize("broken", [False, True])
def test_fla_lookup(tmp_path, monkeypatch, broken):
    """How the triton backend finds fla: an importable fla.ops.kda.chunk_kda, or the import error."""
    import sys

    kda = tmp_path / "fla" / "ops" / "kda"
    kda.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    body = "raise ImportError('triton has no GPU driver here')\n" if broken else ""
    (kda / "__init__.py").write_text(body + "def chunk_kda(*a, **k):\n    return 'fla', a, k\n")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    FB._reset_caches()
    try:
        if broken:
            assert "failed: ImportError: triton has no GPU driver here" in FB._fla_problem("prefill", True)
            with pytest.raises(RuntimeError, match="backend 'triton'.*triton has no GPU driver here"):
                FB.fla_function("prefill")
        else:
            assert FB._fla_problem("prefill", False) == ""  # found, not imported
            assert FB.fla_function("prefill")(1, x=2) == ("fla", (1,), {"x": 2})
        # CPU tensors: rejected for the device whatever fla's state
        _, args, kw = _kimi_call()
        assert "need CUDA tensors, got cpu" in flashkda.explain(*args, **kw).reasons["triton"]
    finally:
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
        FB._reset_caches()


@pytest.mark.parametrize("case", ["kimi_k_first", "softplus", "precomputed", "neg_eigval_fixed_len"])
def test_torch_reference_path_matches_the_op(case):
    """The mapping the CUDA 'reference' backend (float64 PyTorch reference) uses, checked on CPU."""
    gen = torch.Generator().manual_seed(43)
    if case == "precomputed":
        inp = make_inputs([6, 11], H=2, D=64, gate_mode="precomputed", use_qk_l2norm=False,
                          use_beta_sigmoid=False, generator=gen)
        kw = dict(cu_seqlens=inp["cu_seqlens"])
    elif case == "neg_eigval_fixed_len":
        inp = make_inputs(None, B=2, T=7, H=2, D=64, generator=gen)
        kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                  use_gate_in_kernel=True, lower_bound=-3.0, A_log=inp["A_log"])
    else:
        inp = make_inputs([6, 11], H=2, D=128, generator=gen)
        kw = dict(cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if case == "kimi_k_first":
            kw.update(safe_gate=True, lower_bound=-5.0)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    h0 = inp["initial_state"].transpose(-1, -2).contiguous()  # fla's [N, H, K, V]
    o_op, h_op = flashkda.chunk_kda(*args, initial_state=h0, output_final_state=True, **kw)

    fla_args = dict(scale=None, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                    safe_gate=False, lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None,
                    dt_bias=None)
    fla_args.update(kw)
    o_ref, h_ref = FC._flashkda_chunk_kda(
        *args, fla_args["scale"], fla_args["initial_state"], fla_args["output_final_state"],
        fla_args["use_qk_l2norm_in_kernel"], fla_args["use_gate_in_kernel"], fla_args["use_beta_sigmoid_in_kernel"],
        fla_args["allow_neg_eigval"], fla_args["safe_gate"], fla_args["lower_bound"], fla_args["state_v_first"],
        fla_args["cu_seqlens"], fla_args["A_log"], fla_args["dt_bias"], {}, torch_reference=True)
    assert o_ref.dtype == BF16 and o_ref.shape == o_op.shape
    assert h_ref.dtype == torch.float32 and h_ref.shape == h_op.shape and h_ref.is_contiguous()
    assert rel_err(o_ref, o_op.double()) < 1e-2
    assert rel_err(h_ref, h_op.double()) < 1e-5


def _torch_reference_chunk_kda(args, kw):
    """chunk_kda's CUDA 'reference' path (the float64 PyTorch reference), called on CPU tensors."""
    a = dict(scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
             lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)
    a.update(kw)
    return FC._flashkda_chunk_kda(*args, *a.values(), {}, torch_reference=True)


@pytest.mark.parametrize("change", [
    dict(cu_seqlens=torch.tensor([0, 9, 5, 14], dtype=torch.int32)),   # decreasing
    dict(cu_seqlens=torch.tensor([0, 5, 5, 20], dtype=torch.int32)),   # past T (an index out of range)
    dict(cu_seqlens=torch.tensor([0, 5, 5, 12], dtype=torch.int32)),   # ends before T
    dict(cu_seqlens=torch.tensor([2, 5, 5, 14], dtype=torch.int32)),   # does not start at 0
    dict(cu_seqlens=torch.tensor([0.0, 5.0, 5.0, 14.0])),              # not an index dtype
    dict(scale=0.0),                                                    # fla would take it as given
], ids=["decreasing", "past_T", "short", "start", "dtype", "scale_zero"])
def test_torch_reference_path_checks_like_the_op(change):
    """The CUDA 'reference' backend indexes with cu_seqlens: it checks them first (host copy), as the op."""
    _, args, kw = _kimi_call()
    kw.update(change)
    with pytest.raises(ValueError) as op_error:
        flashkda.chunk_kda(*args, backend="reference", **kw)
    with pytest.raises(ValueError) as ref_error:
        _torch_reference_chunk_kda(args, kw)
    assert str(ref_error.value) == str(op_error.value)
    assert str(op_error.value).startswith("flashkda: argument '" + next(iter(change)) + "': expected ")


def test_select_backend_is_generic():
    q = torch.zeros(1, 3, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="kind"):
        flashkda.select_backend("train", q, q, q)
    sel = flashkda.select_backend("prefill", q, q, q, evaluate_all=True)
    assert sel.backend == "reference" and sel.fn == "chunk_kda"
    sel = flashkda.select_backend("decode", q, q, q, evaluate_all=True, unsupported=["flag 'x' is not served"])
    assert sel.kind == "decode" and sel.backend is None
    assert "flag 'x' is not served" in sel.reasons["reference"] and "CUDA tensors" in sel.reasons["triton"]
    assert isinstance(sel.error(), NotImplementedError)
    sel = flashkda.select_backend("decode", q, q, q, backend="cuda")
    assert sel.backend is None and set(sel.reasons) == {"cuda"}  # asked by name: nothing else judged
    assert type(sel.error()) is RuntimeError


def test_backend_argument_under_torch_compile():
    torch._dynamo.reset()
    inp, args, kw = _kimi_call(seed=44)

    def f(q, k, v, g, beta, h0, cu, A_log, dt_bias):
        return flashkda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True,
                                  cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, backend="reference", **KIMI)

    call = (*args, kw["initial_state"], kw["cu_seqlens"], kw["A_log"], kw["dt_bias"])
    o1, h1 = f(*call)
    o2, h2 = torch.compile(f, fullgraph=True, backend="aot_eager")(*call)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    ref_out, ref_fs = R.prefill(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], initial_state=inp["initial_state"],
                                cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o1, ref_out) < 1e-2 and rel_err(h1, ref_fs) < 1e-5


# ---------------------------------------------------------------------------------------------
# flashkda.decode: the same selector with kind="decode"

FD = importlib.import_module("flashkda.decode")  # (the attribute flashkda.decode is the function)


def _decode_call(spec=False, seed=60, lens=(1, 1, 1), P=6):
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(list(lens), H=2, D=64, with_initial_state=False, generator=gen)
    pool = 0.1 * torch.randn(P, 2, 64, 64, generator=gen)
    if spec:
        idx = torch.tensor([[0, 1], [2, 3], [-1, -1]][:len(lens)])
        kw = dict(num_accepted_tokens=torch.tensor([2, 1, 1][:len(lens)]))
    else:
        idx = torch.tensor([4, -1, 1][:len(lens)])
        kw = {}
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx)
    kw.update(cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"])
    return inp, args, kw


def test_decode_auto_picks_reference_for_cpu_tensors():
    _, args, kw = _decode_call()
    sel = flashkda.explain_decode(*args, **kw)
    assert sel.kind == "decode" and sel.fn == "decode" and sel.backend == "reference"
    assert set(sel.reasons) == {"cuda", "triton", "reference"}
    assert "not on a CUDA device" in sel.reasons["cuda"] and "CUDA tensors" in sel.reasons["triton"]
    pool0 = args[5].clone()
    o_auto = flashkda.decode(*args, **kw)
    pool_auto = args[5].clone()
    args[5].copy_(pool0)
    o_ref = flashkda.decode(*args, backend="reference", **kw)
    assert torch.equal(o_auto, o_ref) and torch.equal(pool_auto, args[5])
    assert "flashkda.decode (decode, cpu tensors), backend auto: 'reference'" in str(sel)


def test_decode_backend_by_name_and_env(monkeypatch):
    _, args, kw = _decode_call()
    before = args[5].clone()
    with pytest.raises(RuntimeError, match=r"flashkda.decode: backend 'cuda'.*on cpu, not on a CUDA device"):
        flashkda.decode(*args, backend="cuda", **kw)
    with pytest.raises(RuntimeError, match=r"backend 'triton'.*need CUDA tensors, got cpu"):
        flashkda.decode(*args, backend="triton", **kw)
    monkeypatch.setenv(FB.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' \(asked for by environment variable FLASHKDA_BACKEND\)"):
        flashkda.decode(*args, **kw)
    assert torch.equal(args[5], before)  # nothing ran
    flashkda.decode(*args, backend="reference", **kw)  # the argument wins
    assert flashkda.explain_decode(*args, backend="reference", **kw).source == "argument"
    monkeypatch.setenv(FB.ENV_VAR, "Reference")
    assert flashkda.explain_decode(*args, **kw).backend == "reference"


def test_decode_selection_reasons():
    _, args, kw = _decode_call(spec=True, lens=(2, 1, 1))
    sel = flashkda.explain_decode(*args, **kw)
    assert "speculative decode (2-D ssm_state_indices)" in sel.reasons["triton"]
    q = args[0].clone().requires_grad_(True)
    with pytest.raises(NotImplementedError, match="flashkda: backward is not implemented"):
        flashkda.decode(q, *args[1:], **kw)
    q96 = torch.zeros(1, 3, 2, 96, dtype=BF16)
    with pytest.raises(NotImplementedError, match=r"head dim K == V in \{64, 128\}, got K=96"):
        flashkda.decode(q96, q96, q96, q96, args[4], args[5], args[6], **kw)


def _fake_fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                              state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's fused_recurrent_kda semantics (V-first states), computed by the float64 reference."""
    assert state_v_first and output_final_state and not kwargs
    H, K = q.shape[2], q.shape[3]
    if not use_gate_in_kernel:
        gate_mode = "precomputed"
    else:
        gate_mode = "bounded" if lower_bound is not None else "softplus"
    o, ht = R.prefill(q, k, v, g, beta, scale=scale, gate_mode=gate_mode, A_log=A_log,
                      dt_bias=None if dt_bias is None else dt_bias.reshape(H, K),
                      lower_bound=-5.0 if lower_bound is None else lower_bound,
                      use_qk_l2norm=use_qk_l2norm_in_kernel, use_beta_sigmoid=use_beta_sigmoid_in_kernel,
                      initial_state=initial_state, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), ht.float()


def _triton_selected(kind, q, k, v, *, backend=None, fn=None, tensors=None, unsupported=(), triton_unsupported=(),
                     evaluate_all=False):
    """select_backend's stand-in that takes the triton backend for a plain decode (CPU tensors included)."""
    assert kind == "decode" and not triton_unsupported
    return FB.Selection(kind=kind, fn=fn, backend="triton", requested="triton", source="argument",
                        device=q.device.type, reasons={"triton": None})


@pytest.mark.parametrize("case", ["varlen_token_rows", "fixed_bf16_pool", "softplus"])
def test_decode_triton_path(monkeypatch, case):
    """The triton backend's plumbing (gather, per-request states, padding, write-back), on CPU tensors with
    a fake fla function: it must give what the op gives."""
    gen = torch.Generator().manual_seed(61)
    H_, D_ = 2, 64
    gate_mode = "softplus" if case == "softplus" else "bounded"
    if case == "fixed_bf16_pool":
        inp = make_inputs(None, B=3, T=2, H=H_, D=D_, with_initial_state=False, generator=gen)
        token_rows, out_shape = None, (3, 2, H_, D_)
        pool = (0.1 * torch.randn(6, H_, D_, D_, generator=gen)).to(BF16)
    else:
        inp = make_inputs([2, 0, 1], H=H_, D=D_, with_initial_state=False, gate_mode=gate_mode, generator=gen)
        token_rows = torch.tensor([5, 0, 3])  # rows of an R = 6 step
        pool = 0.1 * torch.randn(6, H_, D_, D_, generator=gen)
        for name in ("q", "k", "v", "g", "beta"):
            x = inp[name]
            big = torch.randn((1, 6) + tuple(x.shape[2:]), generator=gen).to(x.dtype)
            big[:, token_rows] = x
            inp[name] = big
        out_shape = (1, 6, H_, D_)
    idx = torch.tensor([4, -1, 1])
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=inp["dt_bias"], gate_mode=gate_mode,
              token_rows=token_rows)

    monkeypatch.setattr(FD, "select_backend", _triton_selected)
    monkeypatch.setattr(FB, "fla_function", lambda kind: _fake_fused_recurrent_kda)
    p1, p2 = pool.clone(), pool.clone()
    o1 = torch.full(out_shape, 7.0, dtype=BF16)
    o2 = o1.clone()
    flashkda.decode(*args, p1, idx, o1, backend="triton", **kw)
    monkeypatch.undo()
    flashkda.decode(*args, p2, idx, o2, backend="reference", **kw)
    assert rel_err(o1, o2.double()) < 1e-2 and torch.equal(o1 == 7.0, o2 == 7.0)
    assert rel_err(p1, p2.double()) < (1e-2 if pool.dtype == BF16 else 1e-5)
    assert torch.equal(p1[[0, 2, 3, 5]], pool[[0, 2, 3, 5]])  # rows no live request uses


def test_decode_torch_reference_path_matches_the_op():
    """The mapping the CUDA 'reference' backend (float64 PyTorch reference) uses, checked on CPU tensors."""
    _, args, kw = _decode_call(spec=True, lens=(2, 0, 1), P=5)
    q, k, v, g, beta, pool, idx = args
    Rn = 7
    rows = torch.tensor([6, 1, 2])
    big = []
    for x in (q, k, v, g, beta):
        b = torch.zeros((1, Rn) + tuple(x.shape[2:]), dtype=x.dtype)
        b[:, rows] = x
        big.append(b)
    p1, p2 = pool.clone(), pool.clone()
    o1 = torch.full((1, Rn, 2, 64), 7.0, dtype=BF16)
    o2 = o1.clone()
    opts = dict(num_accepted_tokens=kw["num_accepted_tokens"], cu_seqlens=kw["cu_seqlens"], scale=None,
                gate_mode="bounded", A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0, use_qk_l2norm=True,
                use_beta_sigmoid=True, token_rows=rows)
    FD._torch_reference_decode(*big, p1, idx, o1, **opts)
    flashkda.decode(*big, p2, idx, o2, backend="reference", **{k_: v_ for k_, v_ in opts.items() if k_ != "scale"})
    assert rel_err(o1, o2.double()) < 1e-2 and torch.equal(o1 == 7.0, o2 == 7.0)
    assert rel_err(p1, p2.double()) < 1e-5


def test_decode_triton_path_scale(monkeypatch):
    """fla takes None for K^-0.5: flashkda's 0 (like None) is passed as None, a negative scale is refused
    before fla runs (the wrapper used to pass K^-0.5 for it silently)."""
    _, args, kw = _decode_call()
    seen = []

    def recording_fla(*a, scale=None, **k):
        seen.append(scale)
        return _fake_fused_recurrent_kda(*a, scale=scale, **k)

    monkeypatch.setattr(FD, "select_backend", _triton_selected)
    monkeypatch.setattr(FB, "fla_function", lambda kind: recording_fla)
    pool = args[5]
    before = pool.clone()
    out = torch.full((1, 3, 2, 64), 7.0, dtype=BF16)
    with pytest.raises(ValueError, match=r"^flashkda: argument 'scale': expected a finite value > 0, or 0 for "
                                         r"K\^-0\.5, got -0\.5$"):
        flashkda.decode(*args, out, backend="triton", scale=-0.5, **kw)
    assert seen == [] and torch.all(out == 7.0) and torch.equal(pool, before)
    for scale in (None, 0.0, 0.25):
        flashkda.decode(*args[:5], before.clone(), args[6], backend="triton", scale=scale, **kw)
    assert seen == [None, None, 0.25]


@pytest.mark.parametrize("old", [False, True])
def test_fla_decode_signature_check(tmp_path, monkeypatch, old):
    """An fla whose fused_recurrent_kda lacks the gate / layout arguments (it would swallow them in **kwargs
    and compute something else) is rejected with the reason."""
    import sys

    kda = tmp_path / "fla" / "ops" / "kda"
    kda.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    if old:
        body = ("def fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None, "
                "output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):\n    pass\n")
    else:
        body = ("def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
                "output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, "
                "use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False, "
                "cu_seqlens=None, **kwargs):\n    return 'fla'\n")
    (kda / "__init__.py").write_text(body + "def chunk_kda(*a, **k):\n    return 'fla'\n")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    FB._reset_caches()
    try:
        why = FB._fla_problem("decode", True)
        if old:
            assert "has no argument(s) ['A_log', 'dt_bias', 'use_gate_in_kernel'" in why and "upgrade fla" in why
            with pytest.raises(RuntimeError, match="backend 'triton'.*has no argument"):
                FB.fla_function("decode")
        else:
            assert why == "" and FB.fla_function("decode")(1, 2, 3, 4, 5) == "fla"
        assert FB._fla_problem("prefill", True) == ""  # chunk_kda is passed through: no signature demands
    finally:
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
        FB._reset_caches()
