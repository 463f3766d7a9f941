"""Helpers of the kda_step tests (CPU: test_serving.py, CUDA: test_gpu_serving.py): a mixed engine step
(prefill, plain decode and speculative-decode requests in one token batch, rows in any order) and
two independent ways of computing what kda_step must produce:

* ``reference_step``: every group on its own, its tokens gathered, through the float64 reference
  (flashkda.reference.prefill / decode);
* ``gathered_ops_step``: every group on its own, its tokens gathered, through the ops without
  token_rows (flashkda.prefill / torch.ops.flashkda.decode), outputs scattered back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import flashkda
from flashkda import reference as R
from flashkda.serving import DecodeGroup, PrefillGroup, SpecGroup
from request_lifecycle import T_SPEC, Requests

BF16 = torch.bfloat16
SENTINEL = 7.0
TOKEN_NAMES = ("q", "k", "v", "g", "beta")


@dataclass
class StepPlan:
    """The requests of one step.  prefill: (length, pool row, has_initial_state); decode: pool row;
    spec: (length, pool rows [S], num_accepted).  A negative pool row (prefill, decode) or read slot
    (spec) is padding.  extra_rows: rows of the step no group names.  order: how tokens map to rows:
    "grouped" (prefill, then decode, then spec), "reversed", or "shuffled" (seeded by `seed`)."""

    prefill: List[Tuple[int, int, bool]] = field(default_factory=list)
    decode: List[int] = field(default_factory=list)
    spec: List[Tuple[int, List[int], int]] = field(default_factory=list)
    extra_rows: int = 0
    order: str = "shuffled"
    seed: int = 0


@dataclass
class Step:
    inputs: Dict[str, torch.Tensor]  # q, k, v, g [1, R, H, D], beta [1, R, H]
    gate: Dict                        # gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid
    prefill: Optional[PrefillGroup]
    decode: Optional[DecodeGroup]
    spec: Optional[SpecGroup]
    R: int
    named_rows: List[int]             # rows some group names


def _idx(values, dtype, device):
    return torch.tensor(values, dtype=dtype, device=device)


def make_step(plan: StepPlan, H: int, D: int, gen: torch.Generator, device="cpu", idx_dtype=torch.int32,
              gate: Optional[Dict] = None, gate_mode: str = "bounded") -> Step:
    """Random token inputs for `plan` and the three groups (tensors on `device`)."""
    lens_p = [n for n, _, _ in plan.prefill]
    lens_s = [n for n, _, _ in plan.spec]
    total = sum(lens_p) + len(plan.decode) + sum(lens_s)
    Rn = total + plan.extra_rows
    if plan.order == "grouped":
        perm = list(range(Rn))
    elif plan.order == "reversed":
        perm = list(range(Rn))[::-1]
    else:
        perm = list(range(Rn))
        random.Random(plan.seed).shuffle(perm)
    rows = perm[:total]  # logical token j of the step (prefill, decode, spec order) -> its row

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = {name: randn(1, Rn, H, D).to(BF16) for name in ("q", "k", "v", "g")}
    inputs["beta"] = randn(1, Rn, H).to(BF16)
    inputs = {name: t.to(device) for name, t in inputs.items()}
    if gate is None:
        if gate_mode == "precomputed":
            inputs["g"] = torch.nn.functional.logsigmoid(inputs["g"].float() + 1.0).to(BF16)
            gate = dict(gate_mode="precomputed", A_log=None, dt_bias=None, lower_bound=-5.0)
        else:
            gate = dict(gate_mode=gate_mode, A_log=torch.rand(H, generator=gen).to(device),
                        dt_bias=torch.rand(H, D, generator=gen).to(device), lower_bound=-5.0)
        gate.update(use_qk_l2norm=True, use_beta_sigmoid=True)

    def cu(lens):
        c = [0]
        for n in lens:
            c.append(c[-1] + n)
        return _idx(c, idx_dtype, device)

    j = 0
    pre = dec = spc = None
    if plan.prefill:
        t = sum(lens_p)
        pre = PrefillGroup(token_rows=_idx(rows[j:j + t], idx_dtype, device), cu_seqlens=cu(lens_p),
                           state_indices=_idx([s for _, s, _ in plan.prefill], idx_dtype, device),
                           has_initial_state=torch.tensor([h for _, _, h in plan.prefill], device=device))
        j += t
    if plan.decode:
        t = len(plan.decode)
        dec = DecodeGroup(token_rows=_idx(rows[j:j + t], idx_dtype, device),
                          state_indices=_idx(plan.decode, idx_dtype, device),
                          cu_seqlens=cu([1] * t))
        j += t
    if plan.spec:
        t = sum(lens_s)
        spc = SpecGroup(token_rows=_idx(rows[j:j + t], idx_dtype, device), cu_seqlens=cu(lens_s),
                        state_indices=_idx([s for _, s, _ in plan.spec], idx_dtype, device),
                        num_accepted_tokens=_idx([a for _, _, a in plan.spec], idx_dtype, device))
        j += t
    return Step(inputs=inputs, gate=gate, prefill=pre, decode=dec, spec=spc, R=Rn, named_rows=sorted(rows))


def gathered(step: Step, token_rows: torch.Tensor) -> Dict[str, torch.Tensor]:
    rows = token_rows.long()
    return {name: step.inputs[name].index_select(1, rows) for name in TOKEN_NAMES}


def reference_step(step: Step, pool: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [1, R, H, V] float64 with NaN in the rows no group names, pool after the step, float64)."""
    H, D = step.inputs["q"].shape[2], step.inputs["q"].shape[3]
    dev = pool.device
    out = torch.full((1, step.R, H, D), float("nan"), dtype=torch.float64, device=dev)
    pool = pool.double().clone()
    g = step.gate
    if step.prefill is not None:
        p = step.prefill
        o, fin = R.prefill(**gathered(step, p.token_rows), **g, initial_state=pool, cu_seqlens=p.cu_seqlens,
                           state_indices=p.state_indices, has_initial_state=p.has_initial_state)
        pool = R.update_state_pool(pool, fin, p.state_indices)
        out[:, p.token_rows.long()] = o
    for grp in (step.decode, step.spec):
        if grp is None:
            continue
        acc = grp.num_accepted_tokens if isinstance(grp, SpecGroup) else None
        o, pool = R.decode(**gathered(step, grp.token_rows), state_pool=pool, ssm_state_indices=grp.state_indices,
                           num_accepted_tokens=acc, cu_seqlens=grp.cu_seqlens, **g)
        out[:, grp.token_rows.long()] = o
    return out, pool


def gathered_ops_step(step: Step, pool: torch.Tensor, out: torch.Tensor) -> None:
    """The step through the ops without token_rows: each group gathered, run, scattered into `out`;
    `pool` updated in place."""
    g = step.gate
    kw = dict(gate_mode=g["gate_mode"], A_log=g["A_log"], dt_bias=g["dt_bias"], lower_bound=g["lower_bound"],
              use_qk_l2norm=g["use_qk_l2norm"], use_beta_sigmoid=g["use_beta_sigmoid"])
    if step.prefill is not None:
        p = step.prefill
        x = gathered(step, p.token_rows)
        o = flashkda.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw, initial_state=pool, final_state=pool,
                             cu_seqlens=p.cu_seqlens, state_indices=p.state_indices,
                             has_initial_state=p.has_initial_state)
        out.index_copy_(1, p.token_rows.long(), o)
    for grp in (step.decode, step.spec):
        if grp is None:
            continue
        x = gathered(step, grp.token_rows)
        acc = grp.num_accepted_tokens if isinstance(grp, SpecGroup) else None
        o = flashkda.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, grp.state_indices,
                            num_accepted_tokens=acc, cu_seqlens=grp.cu_seqlens, backend="cuda" if pool.is_cuda
                            else "reference", **kw)
        out.index_copy_(1, grp.token_rows.long(), o)


def run_kda_step(step: Step, pool: torch.Tensor, out: Optional[torch.Tensor] = None, workspace=None,
                 flat: bool = False) -> torch.Tensor:
    """kda_step on `step` (out poisoned with SENTINEL when not given); flat: the [R, H, D] layout."""
    if out is None:
        out = torch.full(step.inputs["v"].shape, SENTINEL, dtype=BF16, device=pool.device)
    x = dict(step.inputs)
    o = out
    if flat:
        x = {name: t[0] for name, t in x.items()}
        o = out[0]
    ret = flashkda.kda_step(x["q"], x["k"], x["v"], x["g"], x["beta"], o, pool, **step.gate, workspace=workspace,
                            prefill=step.prefill, decode=step.decode, spec=step.spec)
    assert ret is o
    return out


# A plan with every kind of request and padding in each group, pool rows disjoint (P >= 24).
def mixed_plan(order="shuffled", seed=0, extra_rows=3) -> StepPlan:
    return StepPlan(
        prefill=[(5, 3, True), (0, 7, True), (9, 11, False), (2, -1, True), (1, 0, True)],
        decode=[2, -1, 13, 4],
        spec=[(4, [14, 15, 16, 17], 2), (2, [18, 19, 20, 21], 1), (3, [-1, -1, -1, -1], 1), (1, [22, 23, 5, 6], 3)],
        extra_rows=extra_rows, order=order, seed=seed)


# ---- a multi-step serving simulation ----------------------------------------------------------------

def simulate_serving(device, steps, seed, H, D, out_tol, state_tol, P=48, check_every=10):
    """`steps` engine steps on one pool, each one kda_step of new prefills, continuations, plain and
    speculative decodes (random acceptance, rollback through the slots), padded requests and unused
    rows, in random row orders.  Every step is compared with the float64 reference (reference_step on
    a float64 shadow pool); every `check_every` steps every live request's pool row is compared with
    a prefill of its whole accepted token stream, and free rows must still be NaN.  Returns counts."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((P, H, D, D), float("nan"), device=device)  # free rows are NaN: reading one would show
    shadow = pool.double().clone()
    requests = Requests(rng, P, max_live=9, action_cuts=(0.08, 0.3, 0.6, 0.95))
    gate = dict(gate_mode="bounded", A_log=torch.rand(H, generator=gen).to(device),
                dt_bias=torch.rand(H, D, generator=gen).to(device), lower_bound=-5.0, use_qk_l2norm=True,
                use_beta_sigmoid=True)
    counts = dict(prefill_new=0, prefill_cont=0, decode=0, spec=0, padded=0, finished=0, mixed=0)

    def check_streams(step_no):
        started = [r for r in requests.live if r.started]
        if not started:
            return
        lens = [sum(x.shape[0] for x in r.stream["q"]) for r in started]
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int64, device=device)
        cat = {name: torch.cat([torch.cat(r.stream[name], 0) for r in started], 0).unsqueeze(0)
               for name in TOKEN_NAMES}
        _, fin = R.prefill(**cat, **gate, cu_seqlens=cu)
        for i, r in enumerate(started):
            row = r.rows[r.cur]
            err = R.rel_err(pool[row], fin[i])
            assert err < state_tol, f"step {step_no}: request {r.rid} ({lens[i]} tokens): state rel {err:.2e}"
        owned = {row for r in requests.live for row in r.rows}
        for row in range(P):
            if row not in owned:
                assert torch.isnan(pool[row]).all(), f"step {step_no}: free row {row} was written"

    for step_no in range(steps):
        acts = requests.next_step((pool, shadow), counts)

        # The plan: the requests' own pool rows, plus a padded request per group now and then.
        pre = [(rng.randint(1, 12) if not r.started else rng.randint(0, 6), r.rows[r.cur], r.started)
               for r in acts["prefill"]]
        dec = [r.rows[r.cur] for r in acts["decode"]]
        spec_lens = [rng.randint(1, T_SPEC) for _ in acts["spec"]]
        spc = [(n, list(r.rows), r.cur + 1) for n, r in zip(spec_lens, acts["spec"])]
        pads = 0
        if rng.random() < 0.3:
            pre.append((rng.randint(1, 3), -1, True))
            pads += 1
        if rng.random() < 0.3:
            dec.append(-1)
            pads += 1
        if rng.random() < 0.3:
            spc.append((rng.randint(1, T_SPEC), [-1] * T_SPEC, 1))
            pads += 1
        plan = StepPlan(prefill=pre, decode=dec, spec=spc, extra_rows=rng.randint(0, 3), seed=rng.randint(0, 10**6),
                        order=rng.choice(["shuffled", "shuffled", "grouped", "reversed"]))
        step = make_step(plan, H, D, gen, device=device, idx_dtype=rng.choice([torch.int32, torch.int64]), gate=gate)

        ref_out, shadow = reference_step(step, shadow)
        out = run_kda_step(step, pool, flat=rng.random() < 0.3)
        if step.named_rows:
            named = torch.tensor(step.named_rows, device=device)
            err = R.rel_err(out[:, named], ref_out[:, named])
            assert err < out_tol, f"step {step_no}: out rel {err:.2e}"
        unnamed = [r for r in range(step.R) if r not in set(step.named_rows)]
        assert torch.all(out[:, unnamed] == SENTINEL), f"step {step_no}: an unnamed row was written"
        assert torch.equal(torch.isnan(pool), torch.isnan(shadow)), f"step {step_no}"
        finite = ~torch.isnan(shadow)
        err = R.rel_err(pool[finite], shadow[finite])
        assert err < state_tol, f"step {step_no}: pool rel {err:.2e}"

        # Accept the tokens into each request's stream (in logical order).
        if step.prefill is not None:
            rows, cu = step.prefill.token_rows.tolist(), step.prefill.cu_seqlens.tolist()
            for i, r in enumerate(acts["prefill"]):
                r.accept_rows(step.inputs, rows[cu[i]:cu[i + 1]], cu[i + 1] - cu[i])
                counts["prefill_cont" if r.started else "prefill_new"] += 1
                r.started = True
        if step.decode is not None:
            rows = step.decode.token_rows.tolist()
            for i, r in enumerate(acts["decode"]):
                r.accept_rows(step.inputs, rows[i:i + 1], 1)
                counts["decode"] += 1
        if step.spec is not None:
            rows, cu = step.spec.token_rows.tolist(), step.spec.cu_seqlens.tolist()
            for i, r in enumerate(acts["spec"]):
                accepted = rng.randint(1, spec_lens[i])  # the drafts the verifier kept (+ the bonus token)
                r.accept_rows(step.inputs, rows[cu[i]:cu[i + 1]], accepted)
                r.cur = accepted - 1
                counts["spec"] += 1
        counts["padded"] += pads
        counts["mixed"] += sum(bool(acts[k]) for k in acts) >= 2
        if step_no % check_every == check_every - 1:
            check_streams(step_no)

    check_streams(steps)
    return counts
