"""flashkda.kda_step (one engine step of mixed prefill / decode / spec-decode requests) and the
token_rows argument of the prefill and decode ops, on CPU.

kda_step is judged two ways: against every group run on its own through the float64 reference
(tolerances of the CPU op), and against every group run on its own through the ops on gathered
tensors (bit for bit: token_rows must change where tokens live, nothing else).  Rows no group names
must keep their contents; pool rows no request uses must stay as they were.
"""

import re

import pytest
import torch

import flashkda
from flashkda import reference as R
from flashkda.serving import DecodeGroup, PrefillGroup, SpecGroup
from kda_helpers import make_inputs
from serving_helpers import (BF16, SENTINEL, StepPlan, gathered_ops_step, make_step, mixed_plan, reference_step,
                             run_kda_step, simulate_serving)

H, D = 2, 64
P = 26
OUT_TOL = 1e-2
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def new_pool(gen, dtype=torch.float32, rows=P):
    return (0.1 * torch.randn(rows, H, D, D, generator=gen)).to(dtype)


def check_step(step, pool, flat=False):
    """kda_step on a copy of `pool` against the reference and the gathered ops; returns (out, pool after)."""
    before = pool.clone()
    ref_out, ref_pool = reference_step(step, before)
    exp_out = torch.full(step.inputs["v"].shape, SENTINEL, dtype=BF16)
    exp_pool = before.clone()
    gathered_ops_step(step, exp_pool, exp_out)

    out = run_kda_step(step, pool, flat=flat)
    named = torch.tensor(step.named_rows, dtype=torch.long)
    assert torch.equal(out, exp_out)  # bit for bit, including the untouched rows
    assert torch.equal(pool, exp_pool)
    assert R.rel_err(out[:, named], ref_out[:, named]) < OUT_TOL
    unnamed = [r for r in range(step.R) if r not in set(step.named_rows)]
    assert torch.all(out[:, unnamed] == SENTINEL)
    for row in range(pool.shape[0]):
        if torch.equal(ref_pool[row], before[row].double()):
            assert torch.equal(pool[row], before[row]), f"pool row {row} was written"
        else:
            assert R.rel_err(pool[row], ref_pool[row]) < STATE_TOL[pool.dtype], f"pool row {row}"
    return out, pool


# ---------------------------------------------------------------------------------------------
# Mixed steps

@pytest.mark.parametrize("kinds", ["prefill", "decode", "spec", "prefill+decode", "decode+spec", "all"])
def test_kda_step_groups(kinds):
    gen = torch.Generator().manual_seed(hash(kinds) % 2**31)
    full = mixed_plan(seed=5)
    plan = StepPlan(prefill=full.prefill if "prefill" in kinds or kinds == "all" else [],
                    decode=full.decode if "decode" in kinds or kinds == "all" else [],
                    spec=full.spec if "spec" in kinds or kinds == "all" else [],
                    extra_rows=2, seed=6)
    check_step(make_step(plan, H, D, gen), new_pool(gen))


@pytest.mark.parametrize("order", ["grouped", "reversed", "shuffled"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_kda_step_row_orders(order, idx_dtype):
    gen = torch.Generator().manual_seed(10 + (order == "reversed") + 2 * (idx_dtype == torch.int64))
    step = make_step(mixed_plan(order=order, seed=11, extra_rows=0 if order == "grouped" else 4), H, D, gen,
                     idx_dtype=idx_dtype)
    check_step(step, new_pool(gen))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "precomputed"])
def test_kda_step_gates_and_state_dtypes(state_dtype, gate_mode):
    gen = torch.Generator().manual_seed(20 + ["bounded", "softplus", "precomputed"].index(gate_mode))
    step = make_step(mixed_plan(seed=21), H, D, gen, gate_mode=gate_mode)
    check_step(step, new_pool(gen, state_dtype))


def test_kda_step_flat_layout_and_head_dim_128():
    gen = torch.Generator().manual_seed(30)
    plan = StepPlan(prefill=[(6, 1, True), (3, -1, True)], decode=[0, 4], spec=[(2, [5, 6], 2)], extra_rows=1, seed=3)
    step = make_step(plan, 1, 128, gen)
    pool = (0.1 * torch.randn(8, 1, 128, 128, generator=gen))
    before = pool.clone()
    out4 = run_kda_step(step, pool)
    pool_flat = before.clone()
    out3 = run_kda_step(step, pool_flat, flat=True)  # q [R, H, D], beta [R, H], out [R, H, V]
    assert torch.equal(out4, out3) and torch.equal(pool, pool_flat)


def test_kda_step_padding_only_and_empty_groups():
    gen = torch.Generator().manual_seed(31)
    # every request padded: outputs zeroed at their rows, the pool untouched
    plan = StepPlan(prefill=[(3, -1, True)], decode=[-2], spec=[(2, [-1, 4], 1)], extra_rows=2, seed=1)
    step = make_step(plan, H, D, gen)
    pool = new_pool(gen)
    before = pool.clone()
    out = run_kda_step(step, pool)
    assert torch.equal(pool, before)
    named = torch.tensor(step.named_rows)
    assert torch.count_nonzero(out[:, named]) == 0
    # groups without tokens (a prefill of zero-length sequences, no-token spec requests)
    plan = StepPlan(prefill=[(0, 3, True)], decode=[1], spec=[(0, [5, 6], 1)], extra_rows=1, seed=2)
    check_step(make_step(plan, H, D, gen), new_pool(gen))
    # no group at all: nothing happens
    step = make_step(StepPlan(extra_rows=3), H, D, gen)
    out = run_kda_step(step, pool)
    assert torch.all(out == SENTINEL) and torch.equal(pool, before)


def test_kda_step_workspace_and_decode_cu_seqlens_optional():
    gen = torch.Generator().manual_seed(32)
    step = make_step(mixed_plan(seed=7), H, D, gen)
    pool = new_pool(gen)
    p2 = pool.clone()
    out1 = run_kda_step(step, pool)
    # DecodeGroup without cu_seqlens (built by kda_step), and a CPU workspace (ignored)
    d = step.decode
    step.decode = DecodeGroup(token_rows=d.token_rows, state_indices=d.state_indices)
    ws = torch.empty(flashkda.serving.step_workspace_size(100, H, 8), dtype=torch.uint8)
    out2 = run_kda_step(step, p2, workspace=ws)
    assert torch.equal(out1, out2) and torch.equal(pool, p2)
    assert flashkda.serving.read_step_errors(ws) == {"prefill": 0, "decode": 0, "spec": 0}


def test_kda_step_group_without_token_rows_is_every_row():
    """token_rows=None: the group's tokens are all rows of the step, in order (a one-group step)."""
    gen = torch.Generator().manual_seed(34)
    for plan in (StepPlan(prefill=[(4, 2, True), (0, 5, True), (3, -1, True)], order="grouped"),
                 StepPlan(decode=[3, -1, 0, 6], order="grouped"),
                 StepPlan(spec=[(3, [1, 2, 3], 2), (2, [4, 5, 6], 1)], order="grouped")):
        step = make_step(plan, H, D, gen)
        pool = new_pool(gen)
        p2 = pool.clone()
        out1 = run_kda_step(step, pool)
        for name in ("prefill", "decode", "spec"):
            grp = getattr(step, name)
            if grp is not None:
                setattr(step, name, type(grp)(**dict(grp.__dict__, token_rows=None)))
        if step.decode is not None:  # and let kda_step build its cu_seqlens
            step.decode = DecodeGroup(token_rows=None, state_indices=step.decode.state_indices)
        out2 = run_kda_step(step, p2)
        assert torch.equal(out1, out2) and torch.equal(pool, p2)
    # with a second group, every row is claimed twice
    step = make_step(StepPlan(prefill=[(2, 1, True)], decode=[3], order="grouped"), H, D, gen)
    step.prefill = PrefillGroup(token_rows=None, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
                                state_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="argument 'decode': expected token rows"):
        run_kda_step(step, new_pool(gen))


def test_kda_step_torch_compile_fullgraph():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(33)
    step = make_step(mixed_plan(seed=13), H, D, gen)
    pool = new_pool(gen)
    p2 = pool.clone()

    def f(q, k, v, g, beta, out, pool, A_log, dt_bias, pre, dec, spc):
        flashkda.kda_step(q, k, v, g, beta, out, pool, A_log=A_log, dt_bias=dt_bias, prefill=pre, decode=dec,
                          spec=spc)
        return out.float() * 2

    x = step.inputs
    o1 = torch.full(x["v"].shape, SENTINEL, dtype=BF16)
    o2 = o1.clone()
    common = (step.gate["A_log"], step.gate["dt_bias"], step.prefill, step.decode, step.spec)
    r1 = f(x["q"], x["k"], x["v"], x["g"], x["beta"], o1, pool, *common)
    r2 = torch.compile(f, fullgraph=True, backend="aot_eager")(x["q"], x["k"], x["v"], x["g"], x["beta"], o2, p2,
                                                               *common)
    assert torch.equal(r1, r2) and torch.equal(o1, o2) and torch.equal(pool, p2)


def test_step_workspace_size():
    region = 4096  # the decode header (1024 error words) rounded up to the region alignment (512)
    assert flashkda.serving.step_workspace_size(1000, 16, 8) == 2 * region + flashkda.get_workspace_size(1000, 16, 8)
    assert flashkda.serving.step_workspace_size(0, 16, 0) == 2 * region + flashkda.get_workspace_size(0, 16, 1)
    sizes = [flashkda.serving.step_workspace_size(t, 4, n) for t, n in [(1, 1), (64, 1), (64, 5), (4096, 5)]]
    assert sizes == sorted(sizes)


# ---------------------------------------------------------------------------------------------
# Errors: ValueError naming the argument, nothing written by the rejecting call

def _poisoned(step, pool):
    return torch.full(step.inputs["v"].shape, SENTINEL, dtype=BF16), pool.clone()


def test_kda_step_groups_must_not_share_rows():
    gen = torch.Generator().manual_seed(40)
    step = make_step(mixed_plan(seed=8), H, D, gen)
    pool = new_pool(gen)
    # a decode token on a row the prefill group uses
    d = step.decode
    rows = d.token_rows.clone()
    rows[0] = step.prefill.token_rows[0]
    step.decode = DecodeGroup(token_rows=rows, state_indices=d.state_indices, cu_seqlens=d.cu_seqlens)
    out, p = _poisoned(step, pool)
    with pytest.raises(ValueError, match=r"flashkda: argument 'decode': expected token rows .* also used by "
                                         r"'prefill'"):
        run_kda_step(step, p, out=out)
    assert torch.all(out == SENTINEL) and torch.equal(p, pool)
    # a spec request writing a pool row a decode request uses
    step.decode = d
    s = step.spec
    idx = s.state_indices.clone()
    idx[0, 3] = int(d.state_indices[0])
    step.spec = SpecGroup(token_rows=s.token_rows, cu_seqlens=s.cu_seqlens, state_indices=idx,
                          num_accepted_tokens=s.num_accepted_tokens)
    with pytest.raises(ValueError, match=r"argument 'spec': expected pool rows not used by another group"):
        run_kda_step(step, p, out=out)
    assert torch.all(out == SENTINEL) and torch.equal(p, pool)


@pytest.mark.parametrize("group", ["prefill", "decode", "spec"])
def test_kda_step_bad_token_rows(group):
    gen = torch.Generator().manual_seed(41)
    step = make_step(StepPlan(**{group: mixed_plan().__dict__[group]}, extra_rows=2, seed=4), H, D, gen)
    grp = getattr(step, group)
    rows = grp.token_rows.clone()
    rows[-1] = step.R  # out of range
    setattr(step, group, type(grp)(**dict(grp.__dict__, token_rows=rows)))
    pool = new_pool(gen)
    out, p = _poisoned(step, pool)
    with pytest.raises(ValueError, match=rf"flashkda: argument '{group}.token_rows': expected values in \[0, "):
        run_kda_step(step, p, out=out)
    assert torch.all(out == SENTINEL) and torch.equal(p, pool)


def _replace(step, group, **fields):
    grp = getattr(step, group)
    setattr(step, group, type(grp)(**dict(grp.__dict__, **fields)))


# (id, group, change of its fields, the message: kda_step's argument names); every one in a group that
# runs after another, whose call used to write out and the pool before the error
LATER_GROUP_CASES = [
    ("spec_num_accepted_range", "spec", lambda grp: dict(num_accepted_tokens=grp.num_accepted_tokens + 9),
     r"argument 'spec\.num_accepted_tokens': expected values in \[1, 4\] .*, got spec\.num_accepted_tokens\[0\] = "),
    ("spec_cu_seqlens_end", "spec", lambda grp: dict(cu_seqlens=grp.cu_seqlens[:-1]),
     r"argument 'spec\.cu_seqlens': expected spec\.cu_seqlens\[3\] == T = 10 \(the length of spec\.token_rows\)"),
    ("spec_state_indices_rank", "spec", lambda grp: dict(state_indices=grp.state_indices[..., None]),
     r"argument 'spec\.state_indices': expected rank 1 \[N\] or rank 2 \[N, S\], got rank 3"),
    ("decode_state_index_range", "decode", lambda grp: dict(state_indices=grp.state_indices + P),
     r"argument 'decode\.state_indices': expected values < P = 26 .*, got decode\.state_indices\[0\] = "),
    ("decode_token_rows_dtype", "decode", lambda grp: dict(token_rows=grp.token_rows.float()),
     r"argument 'decode\.token_rows': expected dtype int32 or int64, got float32"),
    ("decode_cu_seqlens_start", "decode", lambda grp: dict(cu_seqlens=grp.cu_seqlens + 1),
     r"argument 'decode\.cu_seqlens': expected decode\.cu_seqlens\[0\] == 0, got 1"),
]


@pytest.mark.parametrize("group,change,match", [c[1:] for c in LATER_GROUP_CASES],
                         ids=[c[0] for c in LATER_GROUP_CASES])
def test_kda_step_validates_every_group_before_running_any(group, change, match):
    gen = torch.Generator().manual_seed(42)
    step = make_step(mixed_plan(seed=14), H, D, gen)
    _replace(step, group, **change(getattr(step, group)))
    pool = new_pool(gen)
    out, p = _poisoned(step, pool)
    with pytest.raises(ValueError, match="flashkda: " + match):
        run_kda_step(step, p, out=out)
    assert torch.all(out == SENTINEL) and torch.equal(p, pool)


def test_kda_step_errors_name_its_own_arguments():
    """The ops' messages name their arguments (initial_state, ssm_state_indices, ...): kda_step's say
    state_pool, decode.state_indices, ..., and the group of a shared argument."""
    gen = torch.Generator().manual_seed(43)
    step = make_step(StepPlan(prefill=[(3, 1, True)], decode=[2, 4], extra_rows=1, seed=5), H, D, gen)
    pool = new_pool(gen).half()  # neither float32 nor bfloat16: the prefill group's call rejects it first
    out, p = _poisoned(step, pool)
    with pytest.raises(ValueError, match=r"^flashkda: argument 'state_pool': expected dtype float32 or bfloat16, "
                                         r"got float16 \(in kda_step's prefill group\)$"):
        run_kda_step(step, p, out=out)
    assert torch.all(out == SENTINEL) and torch.equal(p, pool)
    # the flat layout: every token tensor in it, out included
    x = step.inputs
    with pytest.raises(ValueError, match=r"argument 'out': expected rank 3 \[R, H, V\] \(the flat layout of q\), "
                                         r"got rank 4"):
        flashkda.kda_step(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], out, new_pool(gen),
                          **step.gate, decode=step.decode)
    assert torch.all(out == SENTINEL)
    with pytest.raises(ValueError, match=r"argument 'state_pool': expected a tensor \[P, H, V, K\], got list"):
        flashkda.kda_step(x["q"], x["k"], x["v"], x["g"], x["beta"], out, [0.0], **step.gate, decode=step.decode)


# ---------------------------------------------------------------------------------------------
# token_rows on the ops themselves

def test_prefill_token_rows_equals_gather_run_scatter():
    gen = torch.Generator().manual_seed(50)
    lens = [4, 0, 7, 1]
    inp = make_inputs(lens, H=H, D=D, generator=gen)
    T = sum(lens)
    Rn = T + 5
    rows = torch.randperm(Rn, generator=gen)[:T]
    big = {}
    for name in ("q", "k", "v", "g", "beta"):
        x = inp[name]
        b = torch.full((1, Rn) + tuple(x.shape[2:]), float("nan"), dtype=x.dtype)
        b[:, rows] = x
        big[name] = b
    gate = {key: inp[key] for key in ("gate_mode", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm",
                                      "use_beta_sigmoid")}
    fs1, fs2 = torch.empty(4, H, D, D), torch.empty(4, H, D, D)
    out1 = flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate,
                            initial_state=inp["initial_state"], final_state=fs1, cu_seqlens=inp["cu_seqlens"])
    out2 = torch.full((1, Rn, H, D), SENTINEL, dtype=BF16)
    ret = flashkda.prefill(big["q"], big["k"], big["v"], big["g"], big["beta"], out2, **gate,
                           initial_state=inp["initial_state"], final_state=fs2, cu_seqlens=inp["cu_seqlens"],
                           token_rows=rows)
    assert ret is out2
    assert torch.equal(out2[:, rows], out1) and torch.equal(fs1, fs2)
    rest = torch.ones(Rn, dtype=torch.bool)
    rest[rows] = False
    assert torch.all(out2[:, rest] == SENTINEL)
    ref_out, ref_fs = R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate,
                                initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert R.rel_err(out2[:, rows], ref_out) < OUT_TOL and R.rel_err(fs2, ref_fs) < 1e-5


def test_decode_token_rows_and_workspace_on_cpu():
    gen = torch.Generator().manual_seed(51)
    step = make_step(StepPlan(spec=mixed_plan().spec, extra_rows=3, seed=9), H, D, gen, idx_dtype=torch.int64)
    s = step.spec
    pool = new_pool(gen)
    p1, p2 = pool.clone(), pool.clone()
    out1 = torch.full(step.inputs["v"].shape, SENTINEL, dtype=BF16)
    out2 = out1.clone()
    x = step.inputs
    flashkda.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], p1, s.state_indices, out1,
                    num_accepted_tokens=s.num_accepted_tokens, cu_seqlens=s.cu_seqlens, token_rows=s.token_rows,
                    **step.gate)
    torch.ops.flashkda.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], out2, p2, s.state_indices,
                              num_accepted_tokens=s.num_accepted_tokens, cu_seqlens=s.cu_seqlens,
                              workspace=torch.empty(0, dtype=torch.uint8), token_rows=s.token_rows, **step.gate)
    assert torch.equal(out1, out2) and torch.equal(p1, p2)
    exp_out = torch.full_like(out1, SENTINEL)
    exp_pool = pool.clone()
    gathered_ops_step(step, exp_pool, exp_out)
    assert torch.equal(out1, exp_out) and torch.equal(p1, exp_pool)


def test_opcheck_with_token_rows():
    gen = torch.Generator().manual_seed(52)
    step = make_step(mixed_plan(seed=12), H, D, gen)
    x = step.inputs
    g = dict(step.gate)
    pool = new_pool(gen)
    out = torch.empty(x["v"].shape, dtype=BF16)
    p = step.prefill
    torch.library.opcheck(torch.ops.flashkda.prefill.default,
                          (x["q"], x["k"], x["v"], x["g"], x["beta"], out, torch.empty(0, dtype=torch.uint8)),
                          dict(g, initial_state=pool, final_state=pool.clone(), cu_seqlens=p.cu_seqlens,
                               state_indices=p.state_indices, has_initial_state=p.has_initial_state,
                               token_rows=p.token_rows))
    for grp in (step.decode, step.spec):
        kw = dict(g, cu_seqlens=grp.cu_seqlens, token_rows=grp.token_rows, workspace=torch.empty(0, dtype=torch.uint8))
        if isinstance(grp, SpecGroup):
            kw["num_accepted_tokens"] = grp.num_accepted_tokens
        torch.library.opcheck(torch.ops.flashkda.decode.default,
                              (x["q"], x["k"], x["v"], x["g"], x["beta"], out, pool.clone(), grp.state_indices), kw)


TR_CASES = [
    ("out_of_range", lambda rows, cu: (torch.tensor([0, 1, 2, 99]), cu), "token_rows", r"values in \[0, 8\)"),
    ("negative", lambda rows, cu: (torch.tensor([0, -1, 2, 3]), cu), "token_rows", "values in"),
    ("duplicate", lambda rows, cu: (torch.tensor([5, 1, 5, 3]), cu), "token_rows", "distinct values"),
    ("float", lambda rows, cu: (rows.float(), cu), "token_rows", "dtype int32 or int64"),
    ("rank2", lambda rows, cu: (rows[:, None], cu), "token_rows", "rank 1"),
    ("strided", lambda rows, cu: (torch.stack([rows, rows], 1)[:, 0], cu), "token_rows", "contiguous"),
    ("no_cu_seqlens", lambda rows, cu: (rows, None), "token_rows", "cu_seqlens to be given with it"),
    ("count_mismatch", lambda rows, cu: (rows[:3], cu), "cu_seqlens", r"== T = 3 \(the length of token_rows\)"),
]


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("change,arg,match", [c[1:] for c in TR_CASES], ids=[c[0] for c in TR_CASES])
def test_token_rows_bad_input(op, change, arg, match):
    gen = torch.Generator().manual_seed(53)
    x = {name: torch.randn(1, 8, H, D, generator=gen).to(BF16) for name in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, 8, H, generator=gen).to(BF16)
    gate = dict(A_log=torch.rand(H, generator=gen), dt_bias=torch.rand(H, D, generator=gen))
    rows, cu = change(torch.tensor([6, 0, 3, 1]), torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32))
    out = torch.full((1, 8, H, D), SENTINEL, dtype=BF16)
    pool = torch.full((5, H, D, D), SENTINEL)
    with pytest.raises(ValueError) as info:
        if op == "prefill":
            torch.ops.flashkda.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], out,
                                       torch.empty(0, dtype=torch.uint8), **gate, initial_state=pool,
                                       final_state=pool, cu_seqlens=cu,
                                       state_indices=torch.tensor([0, 1, 2, 3]), token_rows=rows)
        else:
            torch.ops.flashkda.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], out, pool, torch.tensor([0, 1, 2, 3]),
                                      **gate, cu_seqlens=cu, token_rows=rows)
    msg = str(info.value)
    assert f"flashkda: argument '{arg}': expected " in msg, msg
    assert re.search(match, msg), msg
    assert torch.all(out == SENTINEL) and torch.all(pool == SENTINEL)


# ---------------------------------------------------------------------------------------------
# A multi-step pool simulation: every step one kda_step of mixed, shuffled requests

def test_kda_step_serving_simulation():
    counts = simulate_serving(device="cpu", steps=60, seed=7, H=H, D=D, out_tol=OUT_TOL, state_tol=1e-5)
    assert counts["finished"] >= 3 and counts["prefill_new"] >= 8 and counts["prefill_cont"] >= 8
    assert counts["decode"] >= 20 and counts["spec"] >= 20 and counts["padded"] >= 10 and counts["mixed"] >= 20
