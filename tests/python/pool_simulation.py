"""The serving simulation shared by the CPU and the GPU tests: 200 steps of prefills (new and
continued), plain decode and speculative decode with random acceptance on one state pool, checked
against each request's accepted token stream run through the float64 reference.  Free pool rows are
NaN, so a stray read or write shows."""

from __future__ import annotations

import random
from typing import Callable, Optional

import torch

import flashkda
from flashkda import reference as R
from kda_helpers import BF16, make_inputs, rel_err
from request_lifecycle import NAN, T_SPEC, Requests


def _ref_decode(inp, pool, idx, acc=None):
    return R.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, num_accepted_tokens=acc,
                    cu_seqlens=inp["cu_seqlens"], gate_mode=inp["gate_mode"], A_log=inp["A_log"],
                    dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], use_qk_l2norm=inp["use_qk_l2norm"],
                    use_beta_sigmoid=inp["use_beta_sigmoid"])


def run_pool_simulation(*, gen: torch.Generator, rng: random.Random, device, state_dtype, H: int, D: int, P: int,
                        new_len: int, cont_len: int, out_tol: float, state_tol: float, out_fill: float,
                        decode_op: Callable, step_check: Optional[Callable[[int], None]] = None,
                        seed: Optional[int] = None) -> None:
    """decode_op(inp, pool, idx, acc=None) runs our decode and returns out; prefills run through
    flashkda.prefill.  New requests prefill 1..new_len tokens, continuations 0..cont_len.  Every 20
    steps step_check(step) runs (if given) and the pool is checked against the token streams."""
    pool = torch.full((P, H, D, D), NAN, device=device, dtype=state_dtype)  # free rows NaN: a read shows
    shadow = pool.double().clone()  # the pool the float64 reference says we should have
    requests = Requests(rng, P, max_live=10, action_cuts=(0.08, 0.25, 0.55, 0.9))
    A_log = torch.rand(H, generator=gen).to(device)
    dt_bias = torch.rand(H, D, generator=gen).to(device)
    gate = dict(gate_mode="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True,
                use_beta_sigmoid=True)
    counts = dict(prefill_new=0, prefill_cont=0, decode=0, spec=0, spec_varlen=0, padded=0, finished=0)

    def gen_tokens(lens=None, N=1, T=1):
        inp = make_inputs(lens, B=N, T=T, H=H, D=D, device=device, with_initial_state=False, generator=gen)
        inp.update(A_log=A_log, dt_bias=dt_bias)
        return inp

    def check_against_streams(step):
        if pool.is_cuda:
            torch.cuda.synchronize()
        started = [r for r in requests.live if r.started]
        if started:
            lens = [r.tokens("q").shape[0] for r in started]
            cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int64, device=device)
            cat = {name: torch.cat([r.tokens(name) for r in started], 0).unsqueeze(0) for name in started[0].stream}
            _, fin = R.prefill(**cat, **gate, cu_seqlens=cu)
            for i, r in enumerate(started):
                row = r.rows[r.cur]
                e = rel_err(pool[row], fin[i])
                assert e <= state_tol, (f"seed {seed} step {step}: request {r.rid} (row {row}, {lens[i]} tokens): "
                                        f"state rel {e:.3e}")
        owned = {row for r in requests.live for row in r.rows}
        for row in range(P):
            if row not in owned:
                assert torch.isnan(pool[row].float()).all(), f"seed {seed} step {step}: free row {row} was written"
        assert torch.equal(torch.isnan(pool.float()), torch.isnan(shadow)), f"seed {seed} step {step}"

    for step in range(200):
        # arrivals, and an action for every request: new ones prefill; others continue, decode,
        # spec-decode, idle or finish
        acts = requests.next_step((pool, shadow), counts)

        # prefill: new requests (has_initial_state False, their rows are NaN) and continuations,
        # varlen, maybe one padded row
        if acts["prefill"]:
            reqs = acts["prefill"]
            lens = [rng.randint(1, new_len) if not r.started else rng.randint(0, cont_len) for r in reqs]
            pad = rng.random() < 0.3
            inp = gen_tokens(lens + ([rng.randint(1, 4)] if pad else []))
            idx = torch.tensor([r.rows[r.cur] for r in reqs] + ([-1] if pad else []), dtype=torch.int32,
                               device=device)
            has = torch.tensor([r.started for r in reqs] + ([True] if pad else []), device=device)
            ref_out, fin = R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate, initial_state=shadow,
                                     cu_seqlens=inp["cu_seqlens"], state_indices=idx, has_initial_state=has)
            shadow = R.update_state_pool(shadow, fin, idx)
            out = torch.full(inp["v"].shape, out_fill, dtype=BF16, device=device)
            flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, **gate, initial_state=pool,
                             final_state=pool, cu_seqlens=inp["cu_seqlens"], state_indices=idx,
                             has_initial_state=has)
            e = rel_err(out, ref_out)
            assert e <= out_tol, f"seed {seed} step {step}: prefill out rel {e:.3e}"
            cu = inp["cu_seqlens"].tolist()
            for i, r in enumerate(reqs):
                counts["prefill_cont" if r.started else "prefill_new"] += 1
                r.accept(inp, cu[i], lens[i])
                r.started = True
            counts["padded"] += pad

        # plain decode: one token each, fixed layout [N, 1], maybe one padded row
        if acts["decode"]:
            reqs = acts["decode"]
            pad = rng.random() < 0.3
            inp = dict(gen_tokens(N=len(reqs) + pad, T=1), **gate)
            idx = torch.tensor([r.rows[r.cur] for r in reqs] + ([-1] if pad else []), dtype=torch.int64,
                               device=device)
            ref_out, shadow = _ref_decode(inp, shadow, idx)
            out = decode_op(inp, pool, idx)
            e = rel_err(out, ref_out)
            assert e <= out_tol, f"seed {seed} step {step}: decode out rel {e:.3e}"
            for i, r in enumerate(reqs):
                r.accept_row(inp, i, 1)
                counts["decode"] += 1
            counts["padded"] += pad

        # speculative decode: 1 + 3 tokens each (or a varlen draft count), random acceptance; the
        # next step reads the slot of the last accepted token (rollback of the rejected drafts)
        if acts["spec"]:
            reqs = acts["spec"]
            varlen = rng.random() < 0.3
            if varlen:
                lens = [rng.randint(1, T_SPEC) for _ in reqs]
                inp = dict(gen_tokens(lens), **gate)
            else:
                lens = [T_SPEC] * len(reqs)
                inp = dict(gen_tokens(N=len(reqs), T=T_SPEC), **gate)
            idx = torch.tensor([r.rows for r in reqs], dtype=torch.int32, device=device)
            acc = torch.tensor([r.cur + 1 for r in reqs], dtype=torch.int32, device=device)
            ref_out, shadow = _ref_decode(inp, shadow, idx, acc)
            out = decode_op(inp, pool, idx, acc)
            e = rel_err(out, ref_out)
            assert e <= out_tol, f"seed {seed} step {step}: spec out rel {e:.3e}"
            cu = inp["cu_seqlens"].tolist() if varlen else None
            for i, r in enumerate(reqs):
                accepted = rng.randint(1, lens[i])  # the drafts the verifier kept (+ the bonus token)
                if varlen:
                    r.accept(inp, cu[i], accepted)
                else:
                    r.accept_row(inp, i, accepted)
                r.cur = accepted - 1  # the engine continues from that slot
                counts["spec_varlen" if varlen else "spec"] += 1

        if step % 20 == 19:
            if step_check is not None:
                step_check(step)
            check_against_streams(step)

    check_against_streams(200)
    assert counts["finished"] > 5 and counts["prefill_new"] > 10 and counts["prefill_cont"] > 10
    assert counts["decode"] > 50 and counts["spec"] > 50 and counts["spec_varlen"] > 10 and counts["padded"] > 10
