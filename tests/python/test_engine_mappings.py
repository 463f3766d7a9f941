"""The engine mappings of docs/integration.md run as written (CPU: flashkda's reference behind the ops).

SGLang's KDA kernel backend (section 7, "Mapping SGLang's KDA kernel backend"): q, k, v are strided
views of one conv output, beta arrives sigmoid-activated in fp32 for extend and as logits for decode,
A_log is [1, 1, H, 1], dt_bias flat [H * K], the pool [P, H, V, K] is updated in place through int32
cache indices with -1 for padding.  The mapped calls must equal the same math on plain inputs.
"""

import pytest
import torch

import flashkda

BF16 = torch.bfloat16
H, K, P = 2, 64, 6


def _sglang_like(T, gen):
    conv = torch.randn(T, 3 * H * K, generator=gen).to(BF16)  # q, k, v: views of the conv output
    q, k, v = (conv[:, i * H * K:(i + 1) * H * K].unflatten(-1, (H, K)).unsqueeze(0) for i in range(3))
    A_log = torch.rand(1, 1, H, 1, generator=gen)
    dt_bias = torch.rand(H * K, generator=gen)
    return q, k, v, A_log, dt_bias


def _gate(A_log, dt_bias, lower_bound):
    return dict(gate_mode="bounded" if lower_bound is not None else "softplus", A_log=A_log.reshape(-1).float(),
                dt_bias=dt_bias.reshape(H, K).float(), lower_bound=-5.0 if lower_bound is None else lower_bound)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_sglang_extend_mapping(lower_bound):
    gen = torch.Generator().manual_seed(11)
    lens = [5, 3, 0, 70]
    T = sum(lens)
    q, k, v, A_log, dt_bias = _sglang_like(T, gen)
    g = torch.randn(1, T, H, K, generator=gen).to(BF16)
    logits = torch.randn(1, T, H, generator=gen)
    beta = torch.sigmoid(logits)  # Kimi-Linear's extend: activated, fp32 (beta_is_raw False)
    pool = 0.1 * torch.randn(P, H, K, K, generator=gen)
    cache_indices = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 8, 8, 78], dtype=torch.int32)
    gate = _gate(A_log, dt_bias, lower_bound)
    before = pool.clone()
    o = flashkda.prefill(q, k, v, g, beta, None, None, use_qk_l2norm=True, use_beta_sigmoid=False,
                         initial_state=pool, final_state=pool, state_indices=cache_indices,
                         cu_seqlens=query_start_loc, **gate)
    # The same math on contiguous inputs, gathered states, and beta given as logits.
    live = torch.tensor([0, 2, 3])
    rows = cache_indices[live].long()
    h0 = before[rows].clone()
    ht = torch.empty_like(h0)
    cu_live = torch.tensor([0, 5, 5, 75], dtype=torch.int32)
    keep = torch.cat([torch.arange(0, 5), torch.arange(8, 78)])
    o_ref = flashkda.prefill(*(x[:, keep].contiguous() for x in (q, k, v, g)), logits[:, keep].contiguous(), None,
                             None, use_qk_l2norm=True, use_beta_sigmoid=True, initial_state=h0, final_state=ht,
                             cu_seqlens=cu_live, **gate)
    # beta activated by the engine (torch's sigmoid) or in the op: the same to a bf16 ulp (|o| ~ 0.1 here);
    # the wrong flag (the sigmoid applied twice) is off by ~4e-2
    assert torch.allclose(o[:, keep].float(), o_ref.float(), atol=1e-3, rtol=0)
    assert torch.count_nonzero(o[:, 5:8]) == 0  # the padded request's rows
    assert torch.allclose(pool[rows], ht, atol=1e-5, rtol=0)
    untouched = [r for r in range(P) if r not in rows.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_sglang_decode_mapping(lower_bound):
    gen = torch.Generator().manual_seed(12)
    B = 3
    q, k, v, A_log, dt_bias = _sglang_like(B, gen)
    a = torch.randn(B, H * K, generator=gen).to(BF16)  # decode's raw gate, flat
    b = torch.randn(1, B, H, generator=gen).to(BF16)   # decode's beta logits
    pool = 0.1 * torch.randn(P, H, K, K, generator=gen)
    cache_indices = torch.tensor([1, -1, 3], dtype=torch.int32)
    query_start_loc = torch.arange(B + 1, dtype=torch.int32)
    gate = _gate(A_log, dt_bias, lower_bound)
    before = pool.clone()
    o = flashkda.decode(q, k, v, a.view(1, -1, H, K), b, pool, cache_indices, None, cu_seqlens=query_start_loc,
                        use_qk_l2norm=True, use_beta_sigmoid=True, **gate)
    # The same math on plain inputs: contiguous copies, int64 indices, beta activated beforehand.
    pool_ref = before.clone()
    o_ref = flashkda.decode(q.contiguous(), k.contiguous(), v.contiguous(), a.view(1, B, H, K).contiguous(),
                            torch.sigmoid(b.float()), pool_ref, cache_indices.long(), None,
                            cu_seqlens=query_start_loc, use_qk_l2norm=True, use_beta_sigmoid=False, **gate)
    assert torch.allclose(o.float(), o_ref.float(), atol=1e-3, rtol=0)
    assert torch.allclose(pool, pool_ref, atol=1e-5, rtol=0)
    assert torch.count_nonzero(o[:, 1]) == 0 and torch.equal(pool[[0, 2, 4, 5]], before[[0, 2, 4, 5]])
    assert not torch.equal(pool[[1, 3]], before[[1, 3]])
