"""Python side of the ops ``torch.ops.flashkda.*``: fake (meta) kernels and convenience wrappers.

The ops themselves are registered by the C++ library (csrc/torch/flashkda_ops.cpp):

* ``fwd``: the fused "Kimi" configuration (bounded gate, q/k l2norm, beta sigmoid);
* ``prefill``: every gate mode and flag, varlen, state pools (``state_indices``), checkpoint states;
* ``decode``: the recurrent decode / speculative decode on a state pool (wrapper: ``flashkda.decode``);
* ``get_workspace_size`` / ``get_decode_workspace_size``: bytes of workspace a CUDA prefill / decode
  call needs.

``prefill`` and ``decode`` take an optional ``token_rows [T]`` (varlen layout only): the token
tensors then have R rows (dim 1) and logical token t (the t of ``cu_seqlens``) reads its inputs from
and writes its output to row ``token_rows[t]``; other rows are neither read nor written.  This is
how one engine step's tensors hold prefill, decode and speculative tokens in any order
(:func:`flashkda.serving.kda_step`).

They write into caller-provided ``out`` / ``final_state`` / ``workspace`` and return nothing, so
they allocate nothing, never synchronise the host, and can be captured in CUDA graphs and traced by
``torch.compile`` (the fake kernels below do nothing).  The wrappers here allocate what is not
given and return ``out``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .host_checks import bad, check_scale

__all__ = [
    "fwd",
    "prefill",
    "get_workspace_size",
    "get_decode_workspace_size",
    "new_workspace",
    "new_decode_workspace",
    "read_device_error",
    "clear_device_error",
    "DEVICE_ERRORS",
]

Tensor = torch.Tensor

# Codes of the device-side input errors a CUDA call records in its workspace (flashkda::DeviceError).
DEVICE_ERRORS = {
    0: "none",
    1: "cu_seqlens is not non-decreasing from 0 to the token count",
    2: "state_indices holds a value outside [0, P) (negative = padding)",
    3: "token_rows holds a value outside [0, rows)",
    4: "checkpoint_offsets holds a value outside [0, sequence length] or decreasing along a row",
    5: "num_accepted_tokens holds a value outside [1, S]",
    6: "two sequences share a state_indices row (prefill), or ssm_state_indices writes a pool row twice, or a "
       "row one request writes is read by another (decode)",
}


@torch.library.register_fake("flashkda::fwd")
def _fwd_fake(q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound, initial_state=None,
              final_state=None, cu_seqlens=None):
    return None


@torch.library.register_fake("flashkda::prefill")
def _prefill_fake(q, k, v, g, beta, out, workspace, *, scale=0.0, gate_mode="bounded", A_log=None,
                  dt_bias=None, lower_bound=-5.0, use_qk_l2norm=True, use_beta_sigmoid=True,
                  initial_state=None, final_state=None, cu_seqlens=None, state_indices=None,
                  has_initial_state=None, checkpoint_offsets=None, checkpoint_state=None, token_rows=None):
    return None


@torch.library.register_fake("flashkda::decode")
def _decode_fake(q, k, v, g, beta, out, state_pool, ssm_state_indices, *, num_accepted_tokens=None,
                 cu_seqlens=None, scale=0.0, gate_mode="bounded", A_log=None, dt_bias=None, lower_bound=-5.0,
                 use_qk_l2norm=True, use_beta_sigmoid=True, workspace=None, token_rows=None):
    return None


@torch.library.register_fake("flashkda::clear_device_error")
def _clear_device_error_fake(workspace):
    return None


def _check_no_grad(fn: str, *tensors) -> None:
    if not torch.is_grad_enabled():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise NotImplementedError(
                f"flashkda: backward is not implemented (flashkda.{fn} is inference-only, and an input "
                "requires grad); call it under torch.no_grad() or torch.inference_mode(), or detach the inputs"
            )


def get_workspace_size(T_total: int, H: int, N: int = 1) -> int:
    """Bytes of workspace a CUDA call over ``T_total`` tokens, ``H`` heads and ``N`` sequences needs.

    Depends only on these sizes, so an engine can size one buffer for its largest step and reuse it.
    CPU calls need none.  ``N = 0`` (a call without sequences) is sized as 1; the op judges the rest.
    """
    if int(N) < 0:
        raise bad("N", "a sequence count >= 0 (0 is sized as 1)", str(N))
    return int(torch.ops.flashkda.get_workspace_size(int(T_total), int(H), max(int(N), 1)))


def get_decode_workspace_size() -> int:
    """Bytes of workspace a CUDA decode call (``torch.ops.flashkda.decode``) needs; CPU calls need none.

    A constant (the device error header), so one buffer serves every decode call of an engine.
    """
    return int(torch.ops.flashkda.get_decode_workspace_size())


def _problem_sizes(q: Tensor, cu_seqlens: Optional[Tensor], token_rows: Optional[Tensor] = None):
    if q.dim() != 4:  # let the op report the bad shape
        return 1, 1, 1
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    if token_rows is not None and token_rows.dim() == 1:
        T = token_rows.shape[0]  # the logical tokens, not the rows
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None and cu_seqlens.dim() == 1 else B
    return B * T, H, max(N, 1)


def new_workspace(q: Tensor, cu_seqlens: Optional[Tensor] = None, token_rows: Optional[Tensor] = None) -> Tensor:
    """A workspace for a prefill on ``q``: empty on CPU, ``get_workspace_size`` bytes on CUDA.

    With ``token_rows`` it is sized for its length (the logical tokens), not for ``q.shape[1]``.
    Its contents need no initialisation: each CUDA call clears the error word itself.
    """
    if q.device.type != "cuda":
        return torch.empty(0, dtype=torch.uint8, device=q.device)
    T_total, H, N = _problem_sizes(q, cu_seqlens, token_rows)
    return torch.empty(get_workspace_size(T_total, H, N), dtype=torch.uint8, device=q.device)


def new_decode_workspace(q: Tensor) -> Optional[Tensor]:
    """A workspace for a decode on ``q``: None on CPU, ``get_decode_workspace_size`` bytes on CUDA."""
    if q.device.type != "cuda":
        return None
    return torch.empty(get_decode_workspace_size(), dtype=torch.uint8, device=q.device)


def _new_out(q: Tensor, v: Tensor) -> Tensor:
    return torch.empty(v.shape, dtype=torch.bfloat16, device=q.device)


def _op_options(scale: Optional[float], gate_mode: str, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                lower_bound: float, use_qk_l2norm: bool, use_beta_sigmoid: bool) -> Dict:
    """The gate and flag keywords the prefill and decode ops share, in the types of their schemas
    (``scale=None``: 0.0, which the ops read as ``K ** -0.5``; a negative scale is refused here, as
    the ops would, before a wrapper allocates or a step runs anything)."""
    check_scale(scale)
    return dict(scale=0.0 if scale is None else float(scale), gate_mode=gate_mode, A_log=A_log, dt_bias=dt_bias,
                lower_bound=float(lower_bound), use_qk_l2norm=bool(use_qk_l2norm),
                use_beta_sigmoid=bool(use_beta_sigmoid))


def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    out: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
    initial_state: Optional[Tensor] = None,
    final_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """KDA prefill in the fused Kimi configuration; returns ``out`` ``[B, T, H, V]`` bf16.

    q, k, v bf16 ``[B, T, H, D]`` (raw q/k: l2norm is fused), g ``[B, T, H, K]`` raw gate input
    (bounded gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``), beta ``[B, T, H]`` logits
    (sigmoid fused), A_log ``[H]`` fp32, dt_bias ``[H, K]`` fp32.  States are V-first
    ``[N, H, V, K]`` fp32 or bf16; ``final_state`` (written in place) may be ``initial_state``.
    ``out`` and ``workspace`` are allocated when not given.
    """
    _check_no_grad("fwd", q, k, v, g, beta, A_log, dt_bias, initial_state)
    if A_log is None:
        raise ValueError("flashkda.fwd: argument 'A_log' is required (fp32 [H]) by the bounded gate")
    if dt_bias is None:
        raise ValueError("flashkda.fwd: argument 'dt_bias' is required (fp32 [H, K]) by the bounded gate")
    if scale is None:
        scale = 0.0  # the op's "default": K ** -0.5
    if out is None:
        out = _new_out(q, v)
    if workspace is None:
        workspace = new_workspace(q, cu_seqlens)
    torch.ops.flashkda.fwd(q, k, v, g, beta, float(scale), out, workspace, A_log, dt_bias, float(lower_bound),
                           initial_state, final_state, cu_seqlens)
    return out


def prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    out: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    gate_mode: str = "bounded",
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    initial_state: Optional[Tensor] = None,
    final_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    state_indices: Optional[Tensor] = None,
    has_initial_state: Optional[Tensor] = None,
    checkpoint_offsets: Optional[Tensor] = None,
    checkpoint_state: Optional[Tensor] = None,
    token_rows: Optional[Tensor] = None,
) -> Tensor:
    """The general KDA prefill (``torch.ops.flashkda.prefill``); returns ``out``.

    gate_mode: ``"bounded"`` (needs A_log, dt_bias, lower_bound), ``"softplus"`` (needs A_log,
    dt_bias) or ``"precomputed"`` (g is the log decay).  ``use_qk_l2norm`` / ``use_beta_sigmoid``
    switch the fused preprocessing.  With ``state_indices [N]`` the states are a pool
    ``[P, H, V, K]`` and sequence n uses row ``state_indices[n]`` (negative: padded sequence);
    ``has_initial_state [N]`` bool starts the sequences marked False from zeros.

    Checkpoints (prefix caching): with ``checkpoint_offsets [N, n_ckpt]`` int32/int64 (token offsets
    from each sequence's start, ``0 <= off <= len_n``, non-decreasing per row) the state after the
    first ``checkpoint_offsets[n, j]`` tokens of sequence n is written to ``checkpoint_state[n, j]``
    (``[N, n_ckpt, H, V, K]`` fp32, written in place; the two are given together).  Rows of padded
    sequences are left untouched.

    Token rows (one engine step's mixed tensors): with ``token_rows [T]`` int32/int64 (varlen only),
    q, k, g, v, beta and out have R rows (dim 1) and logical token t (the t of ``cu_seqlens``, which
    ends at T) reads row ``token_rows[t]`` and writes its output there; the other rows of ``out`` are
    left untouched (a newly allocated ``out`` holds garbage there).  Values in [0, R), distinct.
    """
    _check_no_grad("prefill", q, k, v, g, beta, A_log, dt_bias, initial_state)
    if out is None:
        out = _new_out(q, v)
    if workspace is None:
        workspace = new_workspace(q, cu_seqlens, token_rows)
    torch.ops.flashkda.prefill(
        q, k, v, g, beta, out, workspace,
        **_op_options(scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid),
        initial_state=initial_state,
        final_state=final_state,
        cu_seqlens=cu_seqlens,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_state=checkpoint_state,
        token_rows=token_rows,
    )
    return out


def read_device_error(workspace: Tensor) -> int:
    """The device-side input error recorded in ``workspace`` by the last CUDA call that used it.

    0 means none (see :data:`DEVICE_ERRORS`).  On CUDA the kernels check the values of the index
    tensors (cu_seqlens, state indices, token_rows, checkpoint offsets, accepted counts) themselves; on
    a bad value they write nothing and record the code here.  This
    synchronises the current stream: a debugging aid, not for hot paths.  CPU calls always give 0
    (the host checks every value before writing).
    """
    return int(torch.ops.flashkda.read_device_error(workspace))


def clear_device_error(workspace: Tensor) -> None:
    """Resets the error word of ``workspace`` (asynchronously, on the current stream)."""
    torch.ops.flashkda.clear_device_error(workspace)
