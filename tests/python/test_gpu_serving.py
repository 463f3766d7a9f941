"""flashkda.kda_step and token_rows on CUDA (the sm90 prefill and decode kernels), against the float64
reference and against the same groups run through the ops on gathered tensors; CUDA-graph capture and
replay of a whole step with new data; device-side validation of token_rows per group.

Skipped unless a CUDA GPU of compute capability 9.0 is present.  Fresh random inputs each run (the
seed is in every failure message); outputs are poisoned with a sentinel first.
"""

import os

import pytest
import torch

import flashkda
from flashkda import reference as R
from flashkda.serving import DecodeGroup, new_step_workspace, read_step_errors
from serving_helpers import (BF16, SENTINEL, StepPlan, gathered_ops_step, make_step, mixed_plan, reference_step,
                             run_kda_step, simulate_serving)


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (sm_90a kernels)")]

DEV = "cuda"
OUT_TOL, STATE_TOL = 4e-3, 3e-3  # the kernels' contract against the float64 reference (kda_spec.md section 6)
LOOSE_OUT, LOOSE_STATE = 1e-2, 1e-2  # bf16 pools, other gate modes
SAME_OUT, SAME_STATE = 1e-3, 1e-5  # the same kernels with and without token_rows (expected: equal)
P = 26


@pytest.fixture
def seed():
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def new_pool(gen, H, D, dtype=torch.float32, rows=P):
    return (0.1 * torch.randn(rows, H, D, D, generator=gen)).to(dtype).to(DEV)


def check_step(step, pool, seed, out_tol=OUT_TOL, state_tol=STATE_TOL, workspace=None, flat=False):
    """kda_step against the float64 reference and against the gathered ops; returns (out, pool after)."""
    before = pool.clone()
    ref_out, ref_pool = reference_step(step, before)
    exp_out = torch.full(step.inputs["v"].shape, SENTINEL, dtype=BF16, device=DEV)
    exp_pool = before.clone()
    gathered_ops_step(step, exp_pool, exp_out)

    out = run_kda_step(step, pool, workspace=workspace, flat=flat)
    torch.cuda.synchronize()
    named = torch.tensor(step.named_rows, dtype=torch.long, device=DEV)
    unnamed = [r for r in range(step.R) if r not in set(step.named_rows)]
    assert torch.all(out[:, unnamed] == SENTINEL), f"seed {seed}: a row no group names was written"
    assert torch.isfinite(out[:, named].float()).all(), f"seed {seed}: out has NaN/Inf"
    e = R.rel_err(out[:, named], ref_out[:, named])
    assert e <= out_tol, f"seed {seed}: out rel {e:.3e} > {out_tol}"
    e = R.rel_err(out[:, named], exp_out[:, named].double())
    assert e <= SAME_OUT, f"seed {seed}: out differs from the gathered ops by {e:.3e}"
    if not torch.equal(out, exp_out):
        print(f"note: kda_step and the gathered ops differ in {int((out != exp_out).sum())} output elements")
    for row in range(pool.shape[0]):
        if torch.equal(ref_pool[row], before[row].double()):
            assert torch.equal(pool[row], before[row]), f"seed {seed}: pool row {row} was written"
        else:
            e = R.rel_err(pool[row], ref_pool[row])
            assert e <= state_tol, f"seed {seed}: pool row {row} rel {e:.3e} > {state_tol}"
            e = R.rel_err(pool[row], exp_pool[row].double())
            assert e <= SAME_STATE, f"seed {seed}: pool row {row} differs from the gathered ops by {e:.3e}"
    if workspace is not None:
        assert read_step_errors(workspace) == {"prefill": 0, "decode": 0, "spec": 0}, f"seed {seed}"
    return out, pool


@pytest.mark.parametrize("kinds", ["prefill", "decode", "spec", "all"])
@pytest.mark.parametrize("D", [64, 128])
def test_kda_step_groups(kinds, D, seed):
    gen = torch.Generator().manual_seed(seed)
    full = mixed_plan(seed=seed)
    plan = StepPlan(prefill=full.prefill if kinds in ("prefill", "all") else [],
                    decode=full.decode if kinds in ("decode", "all") else [],
                    spec=full.spec if kinds in ("spec", "all") else [], extra_rows=3, seed=seed)
    step = make_step(plan, 4, D, gen, device=DEV)
    ws = new_step_workspace(200, 4, 8)
    check_step(step, new_pool(gen, 4, D), seed, workspace=ws)


def test_kda_step_without_prefill_on_the_smallest_workspace(seed):
    """A step with decode and spec groups only accepts a workspace of the two decode regions plus the
    prefill region's error header (which it clears and read_step_errors reads), and refuses one byte
    less before writing anything."""
    gen = torch.Generator().manual_seed(seed)
    full = mixed_plan(seed=seed)
    step = make_step(StepPlan(decode=full.decode, spec=full.spec, extra_rows=2, seed=seed), 4, 128, gen, device=DEV)
    need = 2 * flashkda.serving._region_bytes() + int(torch.ops.flashkda.get_decode_workspace_size())
    pool = new_pool(gen, 4, 128)
    before = pool.clone()
    with pytest.raises(ValueError, match=rf"argument 'workspace': expected at least {need} bytes"):
        run_kda_step(step, pool, workspace=torch.empty(need - 1, dtype=torch.uint8, device=DEV))
    assert torch.equal(pool, before)
    check_step(step, pool, seed, workspace=torch.full((need,), 0xFF, dtype=torch.uint8, device=DEV))


@pytest.mark.parametrize("order", ["grouped", "reversed", "shuffled"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_kda_step_row_orders(order, idx_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    step = make_step(mixed_plan(order=order, seed=seed, extra_rows=0 if order == "grouped" else 5), 4, 128, gen,
                     device=DEV, idx_dtype=idx_dtype)
    check_step(step, new_pool(gen, 4, 128), seed)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "precomputed"])
def test_kda_step_gates_and_state_dtypes(state_dtype, gate_mode, seed):
    gen = torch.Generator().manual_seed(seed)
    step = make_step(mixed_plan(seed=seed), 2, 128, gen, device=DEV, gate_mode=gate_mode)
    strict = state_dtype == torch.float32 and gate_mode == "bounded"
    check_step(step, new_pool(gen, 2, 128, state_dtype), seed, out_tol=OUT_TOL if strict else LOOSE_OUT,
               state_tol=STATE_TOL if strict else LOOSE_STATE, flat=gate_mode == "softplus")


def test_kda_step_long_prefill_rows_interleaved_with_decodes(seed):
    """Prefill sequences longer than a chunk, their rows interleaved with decode and spec rows."""
    gen = torch.Generator().manual_seed(seed)
    plan = StepPlan(prefill=[(300, 1, True), (17, 2, False), (64, -1, True), (131, 3, True)],
                    decode=[4, 5, -1, 6, 7, 8], spec=[(4, [9, 10, 11, 12], 3), (3, [13, 14, 15, 16], 1)],
                    extra_rows=40, seed=seed)
    step = make_step(plan, 4, 128, gen, device=DEV)
    check_step(step, new_pool(gen, 4, 128, rows=20), seed, workspace=new_step_workspace(1000, 4, 8))


def test_decode_backend_auto_is_cuda(seed):
    gen = torch.Generator().manual_seed(seed)
    step = make_step(StepPlan(decode=[3, 0, -1, 5], extra_rows=0, order="grouped"), 2, 128, gen, device=DEV)
    x, dg = step.inputs, step.decode
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], new_pool(gen, 2, 128, rows=8), dg.state_indices)
    kw = dict(cu_seqlens=dg.cu_seqlens, **step.gate)
    sel = flashkda.explain_decode(*args, **kw)
    assert sel.backend == "cuda", str(sel)
    pool0 = args[5].clone()
    out = flashkda.decode(*args, **kw)  # allocates its workspace
    ref_out, ref_pool = R.decode(*args[:5], pool0, dg.state_indices, **kw)
    assert R.rel_err(out, ref_out) <= OUT_TOL, f"seed {seed}"
    assert R.rel_err(args[5], ref_pool) <= STATE_TOL, f"seed {seed}"
    # the op without a workspace: ValueError naming it, nothing written
    before, out2 = args[5].clone(), torch.full_like(out, SENTINEL)
    with pytest.raises(ValueError, match="flashkda: argument 'workspace'"):
        torch.ops.flashkda.decode(*args[:5], out2, args[5], dg.state_indices, **kw)
    torch.cuda.synchronize()
    assert torch.all(out2 == SENTINEL) and torch.equal(args[5], before)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: capture one step, replay it with new data

def _copy_group(dst, src):
    for name, t in dst.__dict__.items():
        if isinstance(t, torch.Tensor):
            t.copy_(getattr(src, name))


def test_kda_step_cuda_graph_replay_with_new_data(seed):
    gen = torch.Generator().manual_seed(seed)
    H, D = 4, 128
    plan_a = StepPlan(prefill=[(5, 3, True), (0, 7, True), (9, 11, False), (2, -1, True), (1, 0, True)],
                      decode=[2, -1, 13, 4], spec=[(4, [14, 15, 16, 17], 2), (2, [18, 19, 20, 21], 1),
                                                   (3, [-1, -1, -1, -1], 1), (1, [22, 23, 5, 6], 3)],
                      extra_rows=3, seed=1)
    # the same shapes (request counts, token totals, slots), other lengths, rows and pool rows
    plan_b = StepPlan(prefill=[(3, 9, False), (6, 1, True), (1, -1, True), (0, 12, True), (7, 24, True)],
                      decode=[-1, 8, 10, 25], spec=[(1, [14, 16, 15, 17], 4), (4, [2, 3, 4, 5], 2),
                                                    (2, [18, 19, 20, 21], 1), (3, [-1, 6, 7, 13], 1)],
                      extra_rows=3, seed=2)
    a = make_step(plan_a, H, D, gen, device=DEV)
    b = make_step(plan_b, H, D, gen, device=DEV, gate=a.gate)
    assert a.R == b.R
    pool_a, pool_b = new_pool(gen, H, D), new_pool(gen, H, D)
    ws = new_step_workspace(a.prefill.token_rows.shape[0], H, a.prefill.cu_seqlens.shape[0] - 1)

    # static buffers: the step's tensors, out, the pool, the groups' index tensors
    static = make_step(plan_a, H, D, gen, device=DEV, gate=a.gate)
    out = torch.full(a.inputs["v"].shape, SENTINEL, dtype=BF16, device=DEV)
    pool = pool_a.clone()

    def step_fn():
        flashkda.kda_step(static.inputs["q"], static.inputs["k"], static.inputs["v"], static.inputs["g"],
                          static.inputs["beta"], out, pool, **static.gate, workspace=ws, prefill=static.prefill,
                          decode=static.decode, spec=static.spec)

    def load(src, src_pool):
        for name, t in static.inputs.items():
            t.copy_(src.inputs[name])
        for grp in ("prefill", "decode", "spec"):
            _copy_group(getattr(static, grp), getattr(src, grp))
        out.fill_(SENTINEL)
        pool.copy_(src_pool)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(a, pool_a)
        step_fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_fn()

    for src, src_pool in ((a, pool_a), (b, pool_b), (a, pool_a)):
        load(src, src_pool)
        graph.replay()
        eager_pool = src_pool.clone()
        eager_out = run_kda_step(src, eager_pool, workspace=new_step_workspace(64, H, 8))
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"seed {seed}: replay out != eager out"
        assert torch.equal(pool, eager_pool), f"seed {seed}: replay pool != eager pool"
        assert read_step_errors(ws) == {"prefill": 0, "decode": 0, "spec": 0}
        ref_out, ref_pool = reference_step(src, src_pool)
        named = torch.tensor(src.named_rows, device=DEV)
        assert R.rel_err(out[:, named], ref_out[:, named]) <= OUT_TOL, f"seed {seed}"


# ---------------------------------------------------------------------------------------------
# Device-side validation: a bad token row is reported per group; the prefill call then writes nothing,
# the decode call skips the request that owns the row

@pytest.mark.parametrize("group", ["prefill", "decode", "spec"])
def test_bad_token_row_is_a_device_error(group, seed):
    gen = torch.Generator().manual_seed(seed)
    step = make_step(StepPlan(**{group: mixed_plan().__dict__[group]}, extra_rows=2, seed=seed), 2, 64, gen,
                     device=DEV)
    grp = getattr(step, group)
    rows = grp.token_rows.clone()
    rows[-1] = step.R + 5  # out of range: only the kernel can see it (no host sync)
    setattr(step, group, type(grp)(**dict(grp.__dict__, token_rows=rows)))
    pool = new_pool(gen, 2, 64)
    before = pool.clone()
    ws = new_step_workspace(64, 2, 8)
    out = run_kda_step(step, pool, workspace=ws)
    torch.cuda.synchronize()
    errors = read_step_errors(ws)
    assert errors[group] == 3, f"seed {seed}: {errors}"  # kBadTokenRow
    assert flashkda.DEVICE_ERRORS[3] == "token_rows holds a value outside [0, rows)"
    assert all(code == 0 for name, code in errors.items() if name != group)
    if group == "prefill":  # the prefill refuses the whole call
        assert torch.all(out == SENTINEL) and torch.equal(pool, before), f"seed {seed}: written despite the error"
    else:  # decode skips the offending request (the last one here): none of its rows or slots is written
        cu = grp.cu_seqlens.tolist() if grp.cu_seqlens is not None else list(range(rows.numel() + 1))
        own = rows[cu[-2]:cu[-1] - 1]  # the request's valid token rows (its last one is the bad row)
        assert torch.all(out[:, own] == SENTINEL), f"seed {seed}: the bad request wrote its output"
        slots = grp.state_indices[-1].reshape(-1).tolist()
        for r in slots:
            if r >= 0:
                assert torch.equal(pool[r], before[r]), f"seed {seed}: the bad request wrote pool row {r}"


def test_read_step_errors_reports_each_group(seed):
    """A bad state index in the decode group only: the other groups run, their errors stay 0."""
    gen = torch.Generator().manual_seed(seed)
    step = make_step(mixed_plan(seed=seed), 2, 64, gen, device=DEV)
    d = step.decode
    idx = d.state_indices.clone()
    idx[0] = P + 3  # >= P
    step.decode = DecodeGroup(token_rows=d.token_rows, state_indices=idx, cu_seqlens=d.cu_seqlens)
    ws = new_step_workspace(64, 2, 8)
    run_kda_step(step, new_pool(gen, 2, 64), workspace=ws)
    torch.cuda.synchronize()
    assert read_step_errors(ws) == {"prefill": 0, "decode": 2, "spec": 0}  # kBadStateIndex


# ---------------------------------------------------------------------------------------------
# Many steps on one pool

def test_kda_step_serving_simulation(seed):
    counts = simulate_serving(device=DEV, steps=80, seed=seed, H=2, D=128, out_tol=OUT_TOL, state_tol=STATE_TOL)
    assert counts["decode"] > 10 and counts["spec"] > 10 and counts["mixed"] > 10, f"seed {seed}: {counts}"

