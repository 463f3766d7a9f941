"""Backend selection of flashkda.chunk_kda: backend=, FLASHKDA_BACKEND, explain(), the generic selector.

CPU-only: these run everywhere.  On a CPU tensor auto must pick the C++ reference, a backend asked
for by name must raise (never fall back) with the reason, and every error names why each backend
was rejected.
"""

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
        return sentinel

    def fake_select(kind, q, k, v, *, backend=None, fn=None, tensors=None, unsupported=(), evaluate_all=False):
        seen["unsupported"] = list(unsupported)
        return FB.Selection(kind=kind, fn=fn, backend="triton", requested="triton", source="argument",
                            device=q.device.type, reasons={"triton": None})

    monkeypatch.setattr(FC, "select_backend", fake_select)
    monkeypatch.setattr(FC, "fla_function", lambda kind: fake_fla_chunk_kda)
    ret = flashkda.chunk_kda(*args, backend="triton", chunk_size=32, head_first=False, **kw)
    assert ret is sentinel
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
