"""``flashkda.decode``: recurrent decode / speculative decode on a state pool (kda_spec.md section 4).

A thin wrapper of ``torch.ops.flashkda.decode`` (registered by the C++ library, fake kernel in
:mod:`flashkda.ops`).  The op reads and writes ``state_pool`` in place and writes ``out``; it
allocates nothing and returns nothing.  This wrapper allocates ``out`` when not given and returns it.

Layout (N requests, H heads, K = V in {64, 128}, P pool rows):

* fixed: q, k, g ``[N, T, H, K]``, v ``[N, T, H, V]``, beta ``[N, T, H]``: every request has T tokens
  (1 for plain decode, 1 + num_spec for speculative decode);
* varlen: the same tensors with a batch of 1 and ``cu_seqlens [N + 1]`` (request n owns tokens
  ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``).

``state_pool [P, H, V, K]`` fp32 or bf16 (V-first).  ``ssm_state_indices``:

* 1-D ``[N]``: request n reads ``state_pool[idx[n]]`` and writes the state after its last token
  back to it;
* 2-D ``[N, S]`` with ``num_accepted_tokens [N]`` (required): request n reads
  ``state_pool[idx[n, num_accepted[n] - 1]]`` and writes the state after its t-th token to
  ``state_pool[idx[n, t]]``.  S == T in the fixed layout.

A negative read slot pads the request (output zeroed, nothing read or written); a negative write
slot skips that write.  Invalid inputs (index >= P, a pool row written twice, a row written by one
request and read by another, num_accepted outside [1, S], ...) raise ``ValueError`` naming the
argument and write nothing.  CUDA tensors raise ``NotImplementedError`` for now (the sm90 decode
kernel is a later task).
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops import _check_no_grad

__all__ = ["decode"]

Tensor = torch.Tensor


def decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    ssm_state_indices: Tensor,
    out: Optional[Tensor] = None,
    *,
    num_accepted_tokens: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    scale: Optional[float] = None,
    gate_mode: str = "bounded",
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
) -> Tensor:
    """KDA decode step(s) on a state pool (``torch.ops.flashkda.decode``); returns ``out`` ``[B, T, H, V]`` bf16.

    ``state_pool`` is updated in place (see the module docstring for which rows).  ``gate_mode``,
    ``A_log``, ``dt_bias``, ``lower_bound``, ``use_qk_l2norm``, ``use_beta_sigmoid`` and ``scale``
    (``None``: ``K ** -0.5``) are those of :func:`flashkda.prefill`.
    """
    _check_no_grad("decode", q, k, v, g, beta, A_log, dt_bias, state_pool)
    if out is None:
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=q.device)
    torch.ops.flashkda.decode(
        q, k, v, g, beta, out, state_pool, ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens,
        cu_seqlens=cu_seqlens,
        scale=0.0 if scale is None else float(scale),
        gate_mode=gate_mode,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=float(lower_bound),
        use_qk_l2norm=bool(use_qk_l2norm),
        use_beta_sigmoid=bool(use_beta_sigmoid),
    )
    return out
