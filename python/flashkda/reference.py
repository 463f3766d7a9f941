"""Float64 pure-PyTorch reference of KDA prefill and decode (the recurrence of kda_spec.md section 2).

This is the ground truth the tests and the demo judge the kernels against: the obvious loop over
tokens, in float64, on the same (bf16) inputs upcast.  To stay fast enough for long sequences it
runs every (sequence, head) pair of a call at once: sequences are gathered into a padded
``[N, L, H, D]`` batch and the loop over ``t < L`` updates only the sequences still running.  Run it
on the GPU (the tensors' device, or ``device=``) for long inputs.

Layouts are those of the ops: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``,
states V-first ``[N, H, V, K]`` (row v holds the K-vector).  With ``cu_seqlens`` B must be 1.
``scale``: as the ops take it (None or 0: ``K ** -0.5``; a negative one raises ValueError).
:func:`decode` is the recurrent decode / speculative decode on a state pool (section 4).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .host_checks import check_scale

__all__ = [
    "l2norm",
    "gate_log_decay",
    "beta_activation",
    "prefill",
    "decode",
    "recurrent",
    "update_state_pool",
    "rel_err",
]

Tensor = torch.Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in the dtype of ``x``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gate_log_decay(
    g: Tensor,
    gate_mode: str = "bounded",
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
) -> Tensor:
    """Per-channel log decay ``a`` (all <= 0) from the gate input ``g`` of shape ``[..., H, K]``.

    bounded:     ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``
    softplus:    ``-exp(A_log[h]) * softplus(g + dt_bias[h])``
    precomputed: ``g``
    """
    g = g.double()
    if gate_mode == "precomputed":
        return g
    if gate_mode not in ("bounded", "softplus"):
        raise ValueError(f"gate_mode must be 'bounded', 'softplus' or 'precomputed', got {gate_mode!r}")
    H, K = g.shape[-2], g.shape[-1]
    if A_log is None or dt_bias is None:
        raise ValueError(f"the {gate_mode} gate needs A_log and dt_bias")
    A = A_log.to(device=g.device, dtype=torch.float64).reshape(H, 1)
    bias = dt_bias.to(device=g.device, dtype=torch.float64).reshape(H, K)
    x = g + bias
    if gate_mode == "bounded":
        return float(lower_bound) * torch.sigmoid(torch.exp(A) * x)
    return -torch.exp(A) * torch.nn.functional.softplus(x)


def beta_activation(beta: Tensor, use_sigmoid: bool = True) -> Tensor:
    beta = beta.double()
    return torch.sigmoid(beta) if use_sigmoid else beta


def recurrent(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float, S: Tensor,
              active: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The token loop on preprocessed float64 inputs, batched over sequences and heads.

    q, k, a: ``[N, L, H, K]``; v: ``[N, L, H, V]``; b: ``[N, L, H]``; S: ``[N, H, V, K]`` (not modified);
    active: ``[N, L]`` bool (token t of sequence n exists), default all.  Returns (o ``[N, L, H, V]``,
    final S).  Per token::

        S <- S * exp(a_t)[None, :];  u = v_t - S @ k_t;  S <- S + b_t u k_t^T;  o_t = scale * S @ q_t
    """
    N, L, H, _ = q.shape
    o = torch.zeros(N, L, H, v.shape[-1], dtype=torch.float64, device=q.device)
    S = S.clone()
    decay = torch.exp(a)
    for t in range(L):
        kt = k[:, t]
        Sn = S * decay[:, t, :, None, :]
        u = v[:, t] - torch.einsum("nhvk,nhk->nhv", Sn, kt)
        Sn = Sn + (b[:, t, :, None, None] * u[..., None]) * kt[:, :, None, :]
        o[:, t] = scale * torch.einsum("nhvk,nhk->nhv", Sn, q[:, t])
        if active is None:
            S = Sn
        else:
            S = torch.where(active[:, t, None, None, None], Sn, S)
    return o, S


def _preprocess(q, k, v, g, beta, scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm,
                use_beta_sigmoid, device):
    """Spec section 2's per-token preprocessing in float64, tokens flattened to ``B * T``, on ``device``
    (None: q's): returns ``(device, scale, q, k, v, a, b)`` with q, k, a ``[B*T, H, K]``, v ``[B*T, H, V]``,
    b ``[B*T, H]``."""
    device = torch.device(device) if device is not None else q.device
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    check_scale(scale)  # the ops' rule: None or 0 is K^-0.5, a negative scale an error
    if not scale:
        scale = K ** -0.5

    def flat(x, d):
        return x.to(device=device, dtype=torch.float64).reshape(B * T, H, d)

    qf, kf, vf = flat(q, K), flat(k, K), flat(v, Vd)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    af = gate_log_decay(g.to(device).reshape(B * T, H, K), gate_mode, A_log, dt_bias, lower_bound)
    bf = beta_activation(beta.to(device).reshape(B * T, H), use_beta_sigmoid)
    return device, scale, qf, kf, vf, af, bf


def _seq_bounds(B: int, T: int, cu_seqlens: Optional[Tensor]):
    if cu_seqlens is None:
        return [(b * T, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1, got {B}")
    return [(cu[n], cu[n + 1] - cu[n]) for n in range(len(cu) - 1)]


def _padded_tokens(seqs, L: int, device, live: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The sequences ``seqs`` ((start, length) pairs) padded to ``L`` tokens: ``active [N, L]`` (token t
    of sequence n exists and, with ``live [N]``, the sequence is live) and the flat index of each active
    token (0 elsewhere, a valid row to gather from)."""
    starts = torch.tensor([s for s, _ in seqs], dtype=torch.long, device=device)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.long, device=device)
    pos = torch.arange(L, device=device)
    active = pos[None, :] < lens[:, None]
    if live is not None:
        active = active & live[:, None]
    return active, torch.where(active, starts[:, None] + pos[None, :], torch.zeros_like(active, dtype=torch.long))


@torch.no_grad()
def prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    gate_mode: str = "bounded",
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    initial_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    state_indices: Optional[Tensor] = None,
    has_initial_state: Optional[Tensor] = None,
    device: Optional[torch.device] = None,
) -> Tuple[Tensor, Tensor]:
    """KDA prefill in float64.  Returns ``(out [B, T, H, V], final [N, H, V, K])``, both float64.

    ``final[n]`` is sequence n's final state.  With ``state_indices`` the states live in a pool
    ``initial_state[P, H, V, K]``: sequence n starts from ``initial_state[state_indices[n]]`` and a
    negative index marks a padded sequence (zero output, state neither read nor written; its row of
    ``final`` is zero).  Use :func:`update_state_pool` to get the pool after the call.
    ``has_initial_state[n] == False`` starts sequence n from zeros.
    """
    device, scale, qf, kf, vf, af, bf = _preprocess(q, k, v, g, beta, scale, gate_mode, A_log, dt_bias,
                                                    lower_bound, use_qk_l2norm, use_beta_sigmoid, device)
    B, T, H, K = q.shape
    Vd = v.shape[-1]

    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)
    active, idx = _padded_tokens(seqs, max([n for _, n in seqs] + [0]), device)  # [N, L]

    idx_list = None
    if state_indices is not None:
        idx_list = [int(x) for x in state_indices.reshape(-1).tolist()]
        if len(idx_list) != N:
            raise ValueError(f"state_indices must have {N} entries, got {len(idx_list)}")
    pad = torch.tensor([i < 0 for i in idx_list] if idx_list else [False] * N, dtype=torch.bool, device=device)

    S0 = torch.zeros(N, H, Vd, K, dtype=torch.float64, device=device)
    if initial_state is not None:
        init = initial_state.to(device=device, dtype=torch.float64)
        for n in range(N):
            row = n if idx_list is None else idx_list[n]
            if row < 0:
                continue
            if has_initial_state is not None and not bool(has_initial_state[n]):
                continue
            S0[n] = init[row]

    if N == 0:
        return torch.zeros(B, T, H, Vd, dtype=torch.float64, device=device), S0
    o_pad, S = recurrent(qf[idx], kf[idx], vf[idx], af[idx], bf[idx], float(scale), S0, active)

    out = torch.zeros(B * T, H, Vd, dtype=torch.float64, device=device)
    keep = active & ~pad[:, None]
    out[idx[keep]] = o_pad[keep]
    S = torch.where(pad[:, None, None, None], torch.zeros_like(S), S)
    return out.reshape(B, T, H, Vd), S


@torch.no_grad()
def decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    ssm_state_indices: Tensor,
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
    device: Optional[torch.device] = None,
) -> Tuple[Tensor, Tensor]:
    """KDA decode on a state pool in float64.  Returns ``(out [B, T, H, V], pool [P, H, V, K])``.

    The semantics of ``flashkda.decode`` (kda_spec.md section 4), on valid inputs: request n reads
    ``pool[idx[n]]`` (1-D indices) or ``pool[idx[n, num_accepted[n] - 1]]`` (2-D), runs its tokens,
    and writes the state after its last token back to ``pool[idx[n]]`` (1-D) or the state after
    token t to ``pool[idx[n, t]]`` (2-D; negative slots are skipped).  A negative read slot pads the
    request: zero output, nothing read or written.  Every read sees the pool as it was before the
    call.  ``pool`` is a float64 copy of ``state_pool`` with those writes applied.
    """
    device, scale, qf, kf, vf, af, bf = _preprocess(q, k, v, g, beta, scale, gate_mode, A_log, dt_bias,
                                                    lower_bound, use_qk_l2norm, use_beta_sigmoid, device)
    B, T, H, K = q.shape
    Vd = v.shape[-1]

    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)
    before = state_pool.to(device=device, dtype=torch.float64)
    pool = before.clone()
    out = torch.zeros(B * T, H, Vd, dtype=torch.float64, device=device)
    if N == 0:
        return out.reshape(B, T, H, Vd), pool
    idx = ssm_state_indices.to(device=device, dtype=torch.long)
    spec = idx.dim() == 2
    if spec:
        if num_accepted_tokens is None:
            raise ValueError("2-D ssm_state_indices need num_accepted_tokens")
        acc = num_accepted_tokens.to(device=device, dtype=torch.long)
        read = idx.gather(1, (acc - 1)[:, None])[:, 0]
    else:
        read = idx
    live = read >= 0  # padded requests: nothing read or written, zero output

    # All requests at once, padded to the longest (as in prefill), one token per step.
    L = max(n for _, n in seqs)
    active, tok = _padded_tokens(seqs, L, device, live)  # [N, L]
    S = torch.zeros(N, H, Vd, K, dtype=torch.float64, device=device)
    S[live] = before[read[live]]
    o = torch.zeros(N, L, H, Vd, dtype=torch.float64, device=device)
    for t in range(L):
        r = tok[:, t:t + 1]
        o_t, S = recurrent(qf[r], kf[r], vf[r], af[r], bf[r], float(scale), S, active[:, t:t + 1])
        o[:, t] = o_t[:, 0]
        if spec and t < idx.shape[1]:  # (a padded request may have more tokens than slots)
            write = active[:, t] & (idx[:, t] >= 0)
            pool[idx[write, t]] = S[write]
    if not spec:
        pool[read[live]] = S[live]
    out[tok[active]] = o[active]
    return out.reshape(B, T, H, Vd), pool


def update_state_pool(pool: Tensor, final: Tensor, state_indices: Optional[Tensor]) -> Tensor:
    """The pool (float64 copy) after a call: rows ``state_indices[n] >= 0`` replaced by ``final[n]``.

    Without ``state_indices`` the result is ``final`` itself (the state tensor is ``[N, H, V, K]``).
    """
    if state_indices is None:
        return final.double()
    out = pool.to(device=final.device, dtype=torch.float64).clone()
    for n, row in enumerate(int(x) for x in state_indices.reshape(-1).tolist()):
        if row >= 0:
            out[row] = final[n]
    return out


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` over the whole tensor (kda_spec.md section 6); inf if x has NaN/Inf."""
    x = x.double().to(ref.device)
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if den == 0:
        return float(num)
    return float(num / den)
