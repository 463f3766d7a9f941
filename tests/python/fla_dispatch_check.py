"""Checks of flashkda.fla_backend inside fla's own chunk_kda dispatch, run by test_fla_backend.py in a
subprocess whose path holds fla (build/fla-site), so that the main test process stays without fla.

On CPU tensors the registered backend serves fla's calls with flashkda's reference (register(backend=
"reference")): what is checked is the wiring (fla's arguments reach flashkda.chunk_kda unchanged, its
return value comes back, calls flashkda cannot serve go on to fla's next backend), not the kernels.
Prints "ok <check>" per check; any failure raises.
"""

import inspect
import os
import sys

import torch

import flashkda
import flashkda.backend as FBK
import flashkda.fla_backend as FB
from kda_helpers import make_inputs

try:  # after flashkda: the order engines import them in
    import fla.backends as fla_backends
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except Exception as e:  # noqa: BLE001 (fla present but not importable here, e.g. no triton)
    print(f"skip: fla not importable: {type(e).__name__}: {e}")
    sys.exit(77)


def registry():
    return fla_backends._function_registries[inspect.unwrap(fla_chunk_kda)]


def kimi_call(state_v_first=False, with_state=True, lens=(5, 70, 0, 64)):
    gen = torch.Generator().manual_seed(7)
    inp = make_inputs(list(lens), H=2, D=64, generator=gen, with_initial_state=with_state)
    h0 = inp["initial_state"]
    if h0 is not None and not state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()  # fla's [N, H, K, V]
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(initial_state=h0, output_final_state=with_state, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              state_v_first=state_v_first, cu_seqlens=inp["cu_seqlens"].long(), A_log=inp["A_log"],
              dt_bias=inp["dt_bias"].flatten())
    return args, kw


def check_registration():
    FB.register(backend="reference")
    FB.register(backend="reference")  # again: replaces, one entry
    order = [(b.backend_type, b.priority) for b in registry()._get_sorted_backends()]
    assert [t for t, _ in order].count("flashkda") == 1, order
    assert order[0] == ("flashkda", 2), order
    assert FB.registered()
    if any(t == "flash_kda" for t, _ in order):  # fla's own FlashKDA backend (MoonshotAI's package)
        assert [t for t, _ in order].index("flashkda") < [t for t, _ in order].index("flash_kda"), order
    print("ok registration")


def check_same_results():
    for state_v_first, with_state in ((False, True), (True, True), (False, False)):
        args, kw = kimi_call(state_v_first, with_state)
        with torch.no_grad():
            o_fla, h_fla = fla_chunk_kda(*args, **kw)
            o_own, h_own = flashkda.chunk_kda(*args, backend="reference", **kw)
        assert torch.equal(o_fla, o_own)
        if with_state:
            assert h_fla.shape == h_own.shape and torch.equal(h_fla, h_own)
        else:
            assert h_fla is None and h_own is None
    # Positional arguments in fla's order (scale, initial_state, output_final_state, ...).
    args, kw = kimi_call()
    with torch.no_grad():
        o_pos, h_pos = fla_chunk_kda(*args, 0.125, kw["initial_state"], True, True, True, True, False, True, -5.0,
                                     cu_seqlens=kw["cu_seqlens"], A_log=kw["A_log"], dt_bias=kw["dt_bias"])
        o_kw, h_kw = flashkda.chunk_kda(*args, backend="reference", **dict(kw, scale=0.125))
    assert torch.equal(o_pos, o_kw) and torch.equal(h_pos, h_kw)
    print("ok same results")


def check_declines():
    be = registry()._backends["flashkda"]
    args, kw = kimi_call()
    ok, why = be.verify("chunk_kda", *args, **kw)
    assert ok and why is None, why
    q32 = args[0].float()
    ok, why = be.verify("chunk_kda", q32, *args[1:], **kw)
    assert not ok and "bfloat16" in why, why
    ok, why = be.verify("chunk_kda", *args, **dict(kw, return_intermediate_states=True))
    assert not ok and "return_intermediate_states" in why, why
    qg = args[0].clone().requires_grad_(True)
    with torch.enable_grad():
        ok, why = be.verify("chunk_kda", qg, *args[1:], **kw)
    assert not ok and "backward" in why, why
    v_grouped = torch.cat([args[2], args[2]], dim=2)  # HV = 2 H
    ok, why = be.verify("chunk_kda", args[0], args[1], v_grouped, *args[3:], **kw)
    assert not ok and "grouped value heads" in why, why
    token = FBK._FLA_SELF_CALL.set(True)  # flashkda's own call of fla (backend="triton")
    try:
        ok, why = be.verify("chunk_kda", *args, **kw)
    finally:
        FBK._FLA_SELF_CALL.reset(token)
    assert not ok and "backend='triton'" in why, why
    for scale in (0.0, -0.5, float("nan")):  # fla would use these as given; flashkda reads 0 as K^-0.5
        ok, why = be.verify("chunk_kda", *args, **dict(kw, scale=scale))
        assert not ok and "scale" in why, why
    ok, why = be.verify("chunk_kda", *args, **dict(kw, use_graph=True, max_num_seqs=4))
    assert not ok and "use_graph" in why, why
    cu_cpu = kw["cu_seqlens"].clone()
    cu_cpu[-1] -= 3  # a padded token buffer: cu_seqlens ends before q's last token
    ok, why = be.verify("chunk_kda", *args, **dict(kw, cu_seqlens_cpu=cu_cpu))
    assert not ok and "cu_seqlens_cpu ends at" in why, why
    assert be.verify("chunk_kda", *args, **dict(kw, cu_seqlens_cpu=kw["cu_seqlens"].clone())) == (True, None)
    for lb in (-10.0, 0.0):  # fla's bounded gate takes any lower_bound without safe_gate; flashkda [-5, 0)
        ok, why = be.verify("chunk_kda", *args, **dict(kw, safe_gate=False, lower_bound=lb))
        assert not ok and "lower_bound" in why, why
    # A bad argument is a decline (fla catches it and goes on), not an exception out of fla's loop.
    ok, why = be.verify("chunk_kda", *args, **dict(kw, not_an_argument=1))
    assert not ok and "not_an_argument" in why, why
    print("ok declines")


def decode_registry():
    return fla_backends._operation_registries["kda"]


def decode_call(spec=False, lens=None, N=5, T=1, P=16, seed=3):
    """fla's fused_recurrent_kda_fwd arguments for a state-pool call (V-first pool, in place)."""
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(lens, B=N, T=T, H=2, D=64, generator=gen, with_initial_state=False)
    n = len(lens) if lens is not None else N
    pool = 0.1 * torch.randn(P, 2, 64, 64, generator=gen)
    perm = torch.randperm(P, generator=gen)
    if spec:
        S = max(lens) if lens is not None else T
        idx = perm[:n * S].view(n, S).to(torch.int32)
        acc = torch.randint(1, S + 1, (n,), generator=gen, dtype=torch.int32)
    else:
        idx, acc = perm[:n].to(torch.int64), None
        idx[1] = -1  # a padded request (flashkda: zero output, no state touched)
    kw = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], A_log=inp["A_log"],
              dt_bias=inp["dt_bias"].flatten(), initial_state=pool, inplace_final_state=True, state_v_first=True,
              cu_seqlens=None if lens is None else inp["cu_seqlens"].long(), ssm_state_indices=idx,
              num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    return kw


def check_decode():
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    order = [b.backend_type for b in decode_registry()._get_sorted_backends() if b.is_available()]
    assert order.count("flashkda") == 1 and order[0] == "flashkda", order  # (triton_ascend: NPUs only)
    for spec, lens, T in ((False, None, 1), (True, None, 3), (False, [1, 0, 1, 1], 1), (True, [2, 3, 1], 1)):
        kw = decode_call(spec=spec, lens=lens, T=T)
        pool = kw["initial_state"]
        own_pool, before = pool.clone(), pool.clone()
        with torch.no_grad():
            o_fla, ht = fused_recurrent_kda_fwd(**kw)
            o_own = flashkda.decode(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], own_pool, kw["ssm_state_indices"],
                                    num_accepted_tokens=kw["num_accepted_tokens"], cu_seqlens=kw["cu_seqlens"],
                                    A_log=kw["A_log"], dt_bias=kw["dt_bias"].view(2, 64), lower_bound=-5.0,
                                    backend="reference")
        assert ht is pool, "fla's in-place contract: the pool is the final state"
        assert torch.equal(o_fla, o_own) and torch.equal(pool, own_pool), (spec, lens, T)
        assert not torch.equal(pool, before), "no state was written"
    # fla's bounded gate without A_log and dt_bias: lower_bound * sigmoid(g), i.e. zeros for both.
    kw = dict(decode_call(), A_log=None, dt_bias=None)
    own_pool = kw["initial_state"].clone()
    with torch.no_grad():
        o_fla, _ = fused_recurrent_kda_fwd(**kw)
        o_own = flashkda.decode(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], own_pool, kw["ssm_state_indices"],
                                A_log=torch.zeros(2), dt_bias=torch.zeros(2, 64), lower_bound=-5.0,
                                backend="reference")
    assert torch.equal(o_fla, o_own) and torch.equal(kw["initial_state"], own_pool)
    be = decode_registry()._backends["flashkda"]
    kw = decode_call()
    assert be.verify("fused_recurrent_kda_fwd", **kw) == (True, None)
    declines = {
        "state-pool mode": dict(kw, ssm_state_indices=None),
        "inplace_final_state": dict(kw, inplace_final_state=False),
        "V-first": dict(kw, state_v_first=False),
        "without num_accepted_tokens": dict(decode_call(spec=True, T=2), num_accepted_tokens=None),
        "T > 1": decode_call(T=2),
        "T > 1 tokens a request": decode_call(lens=[2, 1, 1]),  # varlen: more tokens than requests
        "allow_neg_eigval": dict(kw, allow_neg_eigval=True),
        "per-channel beta": dict(kw, beta=kw["v"].float()),
        "softplus gate without A_log": dict(kw, lower_bound=None, A_log=None),
        "bfloat16": dict(kw, q=kw["q"].float()),
        "unsupported keyword": dict(kw, not_an_argument=1),
        "scale 0.0": dict(kw, scale=0.0),
        "lower_bound -6.0": dict(kw, lower_bound=-6.0),
    }
    for what, bad in declines.items():
        ok, why = be.verify("fused_recurrent_kda_fwd", **bad)
        assert not ok and what in why, (what, why)
    token = FBK._FLA_SELF_CALL.set(True)
    try:
        ok, why = be.verify("fused_recurrent_kda_fwd", **kw)
    finally:
        FBK._FLA_SELF_CALL.reset(token)
    assert not ok and "backend='triton'" in why, why
    print("ok decode")


def check_fall_back():
    """A call the verifier accepts but flashkda refuses when checking it whole goes to fla's own function
    (faked here: fla's Triton kernels need a GPU), with the caller's arguments, and its result comes back."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    seen = []

    def fake_fla(*a, **k):
        seen.append(k)
        return "fla's result"

    saved = FB._fla_default
    FB._fla_default = lambda entry: fake_fla
    try:
        kw = decode_call()
        kw["ssm_state_indices"] = torch.cat([kw["ssm_state_indices"], torch.tensor([7, 9])])  # [N + 2]: fla reads N
        before = kw["initial_state"].clone()
        assert decode_registry()._backends["flashkda"].verify("fused_recurrent_kda_fwd", **kw) == (True, None)
        assert fused_recurrent_kda_fwd(**kw) == "fla's result"
        assert seen and seen[-1]["ssm_state_indices"] is kw["ssm_state_indices"]
        assert torch.equal(kw["initial_state"], before), "flashkda wrote before refusing"
        args, ckw = kimi_call(with_state=False)
        ckw["dt_bias"] = ckw["dt_bias"].view(1, -1)  # [1, H * K]: fla reads it flat; flashkda's op refuses it
        assert registry()._backends["flashkda"].verify("chunk_kda", *args, **ckw) == (True, None)
        with torch.no_grad():
            assert fla_chunk_kda(*args, **ckw) == "fla's result"
        assert seen[-1]["dt_bias"] is ckw["dt_bias"]
        # A_log as SGLang keeps it, [1, 1, H, 1]: flattened by the adapter (as fla does), served, not fallen back.
        n_seen = len(seen)
        args, ckw = kimi_call()
        with torch.no_grad():
            o4, h4 = fla_chunk_kda(*args, **dict(ckw, A_log=ckw["A_log"].view(1, 1, 2, 1)))
            o1, h1 = flashkda.chunk_kda(*args, backend="reference", **ckw)
        assert len(seen) == n_seen and torch.equal(o4, o1) and torch.equal(h4, h1)
    finally:
        FB._fla_default = saved
    print("ok fall back")


def check_switches():
    be = registry()._backends["flashkda"]
    os.environ["FLA_FLASHKDA"] = "0"
    assert not be.is_enabled()
    del os.environ["FLA_FLASHKDA"]
    assert be.is_enabled()
    for bad in (dict(backend="triton"), dict(backend="auto"), dict(priority="2"), dict(priority=True)):
        try:
            FB.register(**bad)
        except ValueError as e:
            assert "argument" in str(e), e
        else:
            raise AssertionError(f"register({bad}) did not raise")
    FB.unregister()
    assert not FB.registered()
    FB.unregister()  # absent: no-op
    print("ok switches")


if __name__ == "__main__":
    check_registration()
    check_same_results()
    check_declines()
    check_decode()
    check_fall_back()
    check_switches()
    sys.exit(0)
