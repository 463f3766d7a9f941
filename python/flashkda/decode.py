"""``flashkda.decode``: recurrent decode / speculative decode on a state pool (kda_spec.md section 4).

A wrapper of ``torch.ops.flashkda.decode`` (registered by the C++ library, fake kernel in
:mod:`flashkda.ops`) with backend selection.  The op reads and writes ``state_pool`` in place and
writes ``out``; it allocates nothing and returns nothing.  This wrapper allocates ``out`` (and, for
CUDA tensors, the workspace) when not given and returns ``out``.

Layout (N requests, H heads, K = V in {64, 128}, P pool rows):

* fixed: q, k, g ``[N, T, H, K]``, v ``[N, T, H, V]``, beta ``[N, T, H]``: every request has T tokens
  (1 for plain decode, 1 + num_spec for speculative decode);
* varlen: the same tensors with a batch of 1 and ``cu_seqlens [N + 1]`` (request n owns logical
  tokens ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``);
* varlen with ``token_rows [T]``: the token tensors have R rows and logical token t lives in row
  ``token_rows[t]`` (rows no token maps to are neither read nor written).

``state_pool [P, H, V, K]`` fp32 or bf16 (V-first).  ``ssm_state_indices``:

* 1-D ``[N]``: request n reads ``state_pool[idx[n]]`` and writes the state after its last token
  back to it;
* 2-D ``[N, S]`` with ``num_accepted_tokens [N]`` (required): request n reads
  ``state_pool[idx[n, num_accepted[n] - 1]]`` and writes the state after its t-th token to
  ``state_pool[idx[n, t]]``.  S == T in the fixed layout.

A negative read slot pads the request (output zeroed, nothing read or written); a negative write
slot skips that write.  Invalid inputs (index >= P, a pool row written twice, a row written by one
request and read by another, num_accepted outside [1, S], ...) raise ``ValueError`` naming the
argument and write nothing (CPU tensors; on CUDA the kernel checks the values and records a device
error instead, see :func:`flashkda.read_device_error`; the "reference" and "triton" backends, which
index with the values in PyTorch, check them on the host first, as the op does for CPU tensors).

Backends (``backend=``, ``FLASHKDA_BACKEND``; :mod:`flashkda.backend`, :func:`explain_decode`):
``"cuda"`` runs the sm90 decode kernel (compute capability 9.0, CUDA build), ``"reference"`` the C++
CPU reference for CPU tensors (or, asked for by name, the float64 PyTorch reference on the GPU),
``"triton"`` fla's ``fused_recurrent_kda`` on gathered pool rows (plain decode with 1-D indices only;
copies and a host synchronisation: a fallback, not for CUDA graphs).  ``"auto"`` takes the first that
serves the call in the order cuda, triton, reference (the reference for CPU tensors only).
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch

from . import host_checks
from . import reference as _reference
from .backend import Selection, call_fla, select_backend
from .ops import _check_no_grad, _new_out, _op_options, new_decode_workspace

__all__ = ["decode", "explain_decode"]

Tensor = torch.Tensor


def _triton_unsupported(ssm_state_indices: Tensor) -> List[str]:
    """Why fla's fused_recurrent_kda (the "triton" backend) cannot serve these arguments."""
    out = []
    if isinstance(ssm_state_indices, torch.Tensor) and ssm_state_indices.dim() == 2:
        out.append("speculative decode (2-D ssm_state_indices) needs the state after every token, which fla's "
                   "fused_recurrent_kda does not return")
    return out


def _select(q, k, v, g, beta, A_log, dt_bias, state_pool, ssm_state_indices, backend,
            evaluate_all=False) -> Selection:
    # The selection reads the tensors' devices, dtypes and shapes: anything else is named here.
    for name, t, layout in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, H, V]"),
                            ("g", g, "[B, T, H, K]"), ("beta", beta, "[B, T, H]"),
                            ("state_pool", state_pool, "[P, H, V, K]"),
                            ("ssm_state_indices", ssm_state_indices, "[N] or [N, S]")):
        host_checks.check_tensor(name, t, layout)
    host_checks.check_tensor("A_log", A_log, "[H]", optional=True)
    host_checks.check_tensor("dt_bias", dt_bias, "[H, K]", optional=True)
    return select_backend(
        "decode", q, k, v, backend=backend, fn="decode",
        tensors={"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                 "state_pool": state_pool},
        triton_unsupported=_triton_unsupported(ssm_state_indices),
        evaluate_all=evaluate_all)


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
    workspace: Optional[Tensor] = None,
    token_rows: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """KDA decode step(s) on a state pool; returns ``out`` ``[B, T, H, V]`` bf16 (``[1, R, H, V]`` with token_rows).

    ``state_pool`` is updated in place (see the module docstring for which rows).  ``gate_mode``,
    ``A_log``, ``dt_bias``, ``lower_bound``, ``use_qk_l2norm``, ``use_beta_sigmoid`` and ``scale``
    (``None``: ``K ** -0.5``) are those of :func:`flashkda.prefill`.  ``workspace``: for CUDA tensors
    at least ``flashkda.get_decode_workspace_size()`` bytes on q's device (allocated when not given;
    pass a preallocated one to stay allocation-free); CPU calls need none.  ``token_rows``: see the
    module docstring.  ``backend``: ``None`` / ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"``.
    """
    sel = _select(q, k, v, g, beta, A_log, dt_bias, state_pool, ssm_state_indices, backend)
    if sel.backend is None:
        raise sel.error()
    _check_no_grad("decode", q, k, v, g, beta, A_log, dt_bias, state_pool)
    if out is None:
        out = _new_out(q, v)
    opts = dict(num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, scale=scale, gate_mode=gate_mode,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid, token_rows=token_rows)
    if sel.backend == "triton":
        _triton_decode(q, k, v, g, beta, state_pool, ssm_state_indices, out, **opts)
        return out
    if sel.backend == "reference" and q.device.type != "cpu":
        _torch_reference_decode(q, k, v, g, beta, state_pool, ssm_state_indices, out, **opts)
        return out
    if workspace is None:
        workspace = new_decode_workspace(q)
    torch.ops.flashkda.decode(
        q, k, v, g, beta, out, state_pool, ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens,
        cu_seqlens=cu_seqlens,
        **_op_options(scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid),
        workspace=workspace,
        token_rows=token_rows,
    )
    return out


def explain_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                   ssm_state_indices: Tensor, *args, **kwargs) -> Selection:
    """Which backend :func:`decode` would use for these arguments, and why the others cannot serve them.

    Takes exactly the arguments of :func:`decode` (``backend=`` and ``FLASHKDA_BACKEND`` included),
    computes nothing, and returns a :class:`flashkda.backend.Selection` (every backend judged).
    """
    bound = inspect.signature(decode).bind(q, k, v, g, beta, state_pool, ssm_state_indices, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return _select(q, k, v, g, beta, a["A_log"], a["dt_bias"], state_pool, ssm_state_indices, a["backend"],
                   evaluate_all=True)


# ---- the backends that are not the op ------------------------------------------------------------
#
# Both check every argument on the host first (flashkda.host_checks: the op's rules and words, on
# host copies of the index tensors): they index with the values, so a bad one would be an
# IndexError, a device-side assert that ends the process, or a silently wrong pool.

def _check_fallback(q, k, v, g, beta, state_pool, ssm_state_indices, out, *, num_accepted_tokens, cu_seqlens,
                    scale, token_rows):
    host_checks.check_scale(scale)
    lay = host_checks.token_layout(q, k, v, g, beta, out, cu_seqlens=cu_seqlens, token_rows=token_rows)
    host_checks.decode_indices(lay, out, state_pool, ssm_state_indices, num_accepted_tokens)


def _gather_rows(xs, token_rows):
    """The logical tokens of a token_rows call: x[:, token_rows] (copies), or xs unchanged."""
    if token_rows is None:
        return xs
    rows = token_rows.to(dtype=torch.long)
    return [x.index_select(1, rows) for x in xs]


def _store_out(out: Tensor, o: Tensor, token_rows: Optional[Tensor]) -> None:
    if token_rows is None:
        out.copy_(o)
    else:
        out.index_copy_(1, token_rows.to(dtype=torch.long), o.to(out.dtype))


def _torch_reference_decode(q, k, v, g, beta, state_pool, ssm_state_indices, out, *, num_accepted_tokens,
                            cu_seqlens, scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm,
                            use_beta_sigmoid, token_rows):
    """Debugging path: the float64 PyTorch reference on the tensors' device, results cast back."""
    _check_fallback(q, k, v, g, beta, state_pool, ssm_state_indices, out, num_accepted_tokens=num_accepted_tokens,
                    cu_seqlens=cu_seqlens, scale=scale, token_rows=token_rows)
    qq, kk, vv, gg, bb = _gather_rows([q, k, v, g, beta], token_rows)
    ref_out, pool = _reference.decode(qq, kk, vv, gg, bb, state_pool, ssm_state_indices,
                                      num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                                      scale=scale, gate_mode=gate_mode, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                                      use_beta_sigmoid=use_beta_sigmoid)
    _store_out(out, ref_out.to(out.dtype), token_rows)
    state_pool.copy_(pool.to(state_pool.dtype))  # rows not written are exact copies of the old ones


def _triton_decode(q, k, v, g, beta, state_pool, ssm_state_indices, out, *, num_accepted_tokens, cu_seqlens,
                   scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid, token_rows):
    """Plain decode (1-D indices) with fla's fused_recurrent_kda: gather the start states of the live
    requests, run fla with per-request states (V-first), zero the outputs of padded requests, and write
    the final states back (a host synchronisation: the live rows are selected by value)."""
    _check_fallback(q, k, v, g, beta, state_pool, ssm_state_indices, out, num_accepted_tokens=num_accepted_tokens,
                    cu_seqlens=cu_seqlens, scale=scale, token_rows=token_rows)
    idx = ssm_state_indices.to(dtype=torch.long)
    N = idx.shape[0]
    if N == 0:
        return  # no requests, hence no tokens
    qq, kk, vv, gg, bb = _gather_rows([q, k, v, g, beta], token_rows)
    live = idx >= 0
    h0 = state_pool.index_select(0, idx.clamp(min=0)).float()
    h0 = torch.where(live[:, None, None, None], h0, torch.zeros_like(h0))
    gated = gate_mode != "precomputed"
    o, ht = call_fla(
        "decode", qq, kk, vv, gg, bb,
        A_log=A_log if gated else None,
        dt_bias=dt_bias.reshape(-1) if gated and dt_bias is not None else None,
        scale=float(scale) if scale else None,  # flashkda's 0 (like None) is K^-0.5; fla's is None
        initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
        use_gate_in_kernel=gated,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid),
        lower_bound=float(lower_bound) if gate_mode == "bounded" else None,
        state_v_first=True,
        cu_seqlens=cu_seqlens)
    # Padded requests: zero output.
    if cu_seqlens is None:
        tok_live = live[:, None].expand(N, qq.shape[1])
    else:
        T = qq.shape[1]
        pos = torch.arange(T, device=q.device)
        req = torch.searchsorted(cu_seqlens[1:].to(dtype=torch.long).contiguous(), pos, right=True)
        tok_live = live[req.clamp(max=N - 1)][None, :]  # the request that owns each token
    o = torch.where(tok_live[..., None, None], o, torch.zeros_like(o))
    _store_out(out, o.to(out.dtype), token_rows)
    rows = idx[live]
    state_pool.index_copy_(0, rows, ht[live].to(state_pool.dtype))
