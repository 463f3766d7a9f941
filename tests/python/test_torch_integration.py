"""The ops as PyTorch sees them: schemas, opcheck, torch.compile, workspace size, autograd guard."""

import pytest
import torch

import flashkda
from kda_helpers import make_inputs, new_outputs, op_kwargs, reference, rel_err

FWD_SCHEMA = (
    "flashkda::fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
    "Tensor(c!) workspace, Tensor A_log, Tensor dt_bias, float lower_bound, Tensor? initial_state=None, "
    "Tensor(b!)? final_state=None, Tensor? cu_seqlens=None) -> ()"
)
PREFILL_SCHEMA = (
    "flashkda::prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, Tensor(c!) workspace, *, "
    "float scale=0.0, str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, "
    "float lower_bound=-5.0, bool use_qk_l2norm=True, bool use_beta_sigmoid=True, "
    "Tensor? initial_state=None, Tensor(b!)? final_state=None, Tensor? cu_seqlens=None, "
    "Tensor? state_indices=None, Tensor? has_initial_state=None, Tensor? checkpoint_offsets=None, "
    "Tensor(d!)? checkpoint_state=None, Tensor? token_rows=None) -> ()"
)
WS_SCHEMA = "flashkda::get_workspace_size(int T_total, int H, int N=1) -> int"


def test_schemas():
    assert str(torch.ops.flashkda.fwd.default._schema) == FWD_SCHEMA
    # printing normalises float defaults (0.0 -> 0.): compare parsed schemas
    assert torch.ops.flashkda.prefill.default._schema == torch._C.parse_schema(PREFILL_SCHEMA)
    assert str(torch.ops.flashkda.prefill.default._schema) == str(torch._C.parse_schema(PREFILL_SCHEMA))
    assert str(torch.ops.flashkda.get_workspace_size.default._schema) == WS_SCHEMA


def test_library_loaded_from_package():
    assert flashkda._library_path.startswith(flashkda.__path__[0])
    assert isinstance(flashkda.built_with_cuda(), bool)


def _fwd_args(inp, fs):
    out, _ = new_outputs(inp)
    ws = torch.empty(0, dtype=torch.uint8)
    return (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 64 ** -0.5, out, ws, inp["A_log"], inp["dt_bias"],
            -5.0, inp["initial_state"], fs, inp["cu_seqlens"])


@pytest.mark.parametrize("varlen", [True, False])
def test_opcheck_fwd(varlen):
    gen = torch.Generator().manual_seed(30)
    inp = make_inputs([3, 0, 6] if varlen else None, B=2, T=5, H=2, D=64, generator=gen)
    _, fs = new_outputs(inp)
    torch.library.opcheck(torch.ops.flashkda.fwd.default, _fwd_args(inp, fs))


@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "precomputed"])
def test_opcheck_prefill(gate_mode):
    gen = torch.Generator().manual_seed(31)
    inp = make_inputs([4, 5], H=2, D=64, gate_mode=gate_mode, generator=gen)
    out, fs = new_outputs(inp)
    kw = op_kwargs(inp)
    kw.update(final_state=fs, scale=0.2)
    if gate_mode == "precomputed":
        kw.update(A_log=None, dt_bias=None)
    ws = torch.empty(0, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.flashkda.prefill.default,
                          (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, ws), kw)


def test_opcheck_prefill_state_pool():
    gen = torch.Generator().manual_seed(32)
    inp = make_inputs([4, 5, 2], H=2, D=64, with_initial_state=False, generator=gen)
    pool = torch.randn(5, 2, 64, 64, generator=gen) * 0.1
    out, _ = new_outputs(inp)
    kw = op_kwargs(inp)
    kw.update(initial_state=pool, final_state=torch.zeros_like(pool),
              state_indices=torch.tensor([4, -1, 1], dtype=torch.int64),
              has_initial_state=torch.tensor([True, True, False]))
    torch.library.opcheck(torch.ops.flashkda.prefill.default,
                          (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out,
                           torch.empty(0, dtype=torch.uint8)), kw)


class KimiLayer(torch.nn.Module):
    def __init__(self, A_log, dt_bias):
        super().__init__()
        self.register_buffer("A_log", A_log)
        self.register_buffer("dt_bias", dt_bias)

    def forward(self, q, k, v, g, beta, h0, cu_seqlens, workspace):
        out = torch.empty_like(v)
        ht = torch.empty_like(h0)
        torch.ops.flashkda.fwd(q, k, v, g, beta, q.shape[-1] ** -0.5, out, workspace, self.A_log, self.dt_bias,
                               -5.0, h0, ht, cu_seqlens)
        return out * 2, ht


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(33)
    inp = make_inputs([6, 10], H=2, D=64, generator=gen)
    layer = KimiLayer(inp["A_log"], inp["dt_bias"])
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["initial_state"], inp["cu_seqlens"],
            torch.empty(0, dtype=torch.uint8))
    eager_out, eager_ht = layer(*args)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out, ht = compiled(*args)
    assert torch.equal(out, eager_out) and torch.equal(ht, eager_ht)
    ref_out, ref_fs = reference(inp)
    assert rel_err(out / 2, ref_out) < 1e-2 and rel_err(ht, ref_fs) < 1e-5


def test_torch_compile_wrapper():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(34)
    inp = make_inputs([6, 3], H=2, D=64, generator=gen)

    def f(q, k, v, g, beta, A_log, dt_bias, h0, cu):
        return flashkda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                  A_log=A_log, dt_bias=dt_bias)

    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"],
            inp["initial_state"], inp["cu_seqlens"])
    o1, h1 = f(*args)
    o2, h2 = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_get_workspace_size():
    n = flashkda.get_workspace_size(16384, 16, 8)
    assert isinstance(n, int) and n >= 4  # at least the device error word
    assert n == torch.ops.flashkda.get_workspace_size(16384, 16, 8)
    assert torch.ops.flashkda.get_workspace_size(100, 4) == torch.ops.flashkda.get_workspace_size(100, 4, 1)
    small = flashkda.get_workspace_size(1, 1, 1)
    assert small <= n
    assert flashkda.get_workspace_size(0, 1, 1) >= 4
    for bad in [(-1, 4, 1), (10, 0, 1), (10, 4, 0)]:
        with pytest.raises(ValueError):
            torch.ops.flashkda.get_workspace_size(*bad)
    assert flashkda.new_workspace(torch.empty(1, 2, 3, 64)).numel() == 0  # CPU needs none


@pytest.mark.parametrize("sizes,match", [
    ((-1, 4, 1), r"argument 'T_total': expected >= 0, got -1$"),
    ((10, 0, 1), r"argument 'H': expected >= 1, got 0$"),
    ((10, 4, -2), r"argument 'N': expected a sequence count >= 0 \(0 is sized as 1\), got -2$"),
], ids=["T_total", "H", "N"])
def test_get_workspace_size_argument_errors(sizes, match):
    with pytest.raises(ValueError, match="^flashkda: " + match):
        flashkda.get_workspace_size(*sizes)
    with pytest.raises(ValueError, match=r"^flashkda: argument 'N': expected >= 1, got 0$"):
        torch.ops.flashkda.get_workspace_size(10, 4, 0)  # the op itself; the wrapper sizes N = 0 as 1
    assert flashkda.get_workspace_size(10, 4, 0) == flashkda.get_workspace_size(10, 4, 1)


@pytest.mark.parametrize("fn", ["fwd", "prefill", "chunk_kda"])
@pytest.mark.parametrize("which", ["q", "g", "A_log"])
def test_requires_grad_raises(fn, which):
    gen = torch.Generator().manual_seed(35)
    inp = make_inputs([4], H=2, D=64, generator=gen)
    inp[which] = inp[which].clone().requires_grad_(True)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    out, _ = new_outputs(inp)
    before = out.clone()
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], cu_seqlens=inp["cu_seqlens"])
    with pytest.raises(NotImplementedError, match="flashkda: backward is not implemented"):
        if fn == "fwd":
            flashkda.fwd(*args, out=out, **kw)
        elif fn == "prefill":
            flashkda.prefill(*args, out, **kw)
        else:
            flashkda.chunk_kda(*args, use_gate_in_kernel=True, lower_bound=-5.0, **kw)
    assert torch.equal(out, before)
    with torch.no_grad():  # fine without autograd
        flashkda.fwd(*args, out=out, **kw)


def test_read_device_error_cpu():
    ws = torch.empty(0, dtype=torch.uint8)
    assert flashkda.read_device_error(ws) == 0
    flashkda.clear_device_error(ws)
