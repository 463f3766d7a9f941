"""``flashkda.chunk_kda``: a drop-in for the forward of fla's ``fla.ops.kda.chunk_kda``.

Same arguments, same positional order and the same return value ``(o, final_state)`` as fla's
function, plus a keyword-only ``backend``: ``None`` / ``"auto"`` (the default; the environment
variable ``FLASHKDA_BACKEND`` replaces it when set), ``"cuda"``, ``"triton"`` or ``"reference"``
(see :mod:`flashkda.backend`).  Auto runs flashkda's sm_90a kernels when they can serve the call,
else fla's Triton ``chunk_kda`` (the call passed through unchanged) for CUDA tensors when fla is
importable, else flashkda's C++ reference for CPU tensors, else raises with the reason each backend
was rejected.  :func:`explain` tells, for the same arguments, which backend auto picks and why.

How fla's arguments map onto ``torch.ops.flashkda.prefill`` (backends "cuda" and "reference"):

* ``use_gate_in_kernel=False``: ``g`` is the log decay, used as is (gate mode "precomputed").
* ``use_gate_in_kernel=True``: ``g`` is the raw gate input.  With ``lower_bound`` given the gate is
  the bounded one, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (fla's ``safe_gate`` path;
  ``A_log=None`` means ``exp(A_log) = 1``); otherwise ``-exp(A_log) * softplus(g + dt_bias)``.
  ``dt_bias=None`` means no bias.
* ``use_qk_l2norm_in_kernel`` / ``use_beta_sigmoid_in_kernel``: fused l2norm of q, k / sigmoid of
  beta; otherwise q, k and beta are used as given.
* States: fla's default layout ``[N, H, K, V]``, or ``[N, H, V, K]`` with ``state_v_first=True``
  (the kernels' own layout: no transposes).  The final state is returned in fp32.

flashkda's own backends are inference only: what they cannot compute (backward, grouped value
heads, dtypes other than bf16 for q/k/v, head dims other than 64/128, context parallelism,
intermediate states, fla's padded graph mode, unknown keyword arguments) makes auto use fla when it can, and raises
``NotImplementedError`` otherwise; argument errors raise ``ValueError``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Dict, List, Optional

import torch

from . import host_checks
from . import reference as _reference
from .backend import Selection, call_fla, select_backend
from .ops import _new_out, _op_options, new_workspace

__all__ = ["chunk_kda", "explain"]

Tensor = torch.Tensor

# Keyword arguments (through **kwargs) of fla's chunk_kda that flashkda's backends understand.
_SERVED_KWARGS = ("chunk_size", "transpose_state_layout")


def _rows_contiguous(x: Tensor) -> Tensor:
    """x with a contiguous [H, D] block per token (any token/batch stride is read in place)."""
    if x.dim() == 4:
        if x.stride(-1) == 1 and (x.shape[-2] <= 1 or x.stride(-2) == x.shape[-1]):
            return x
        return x.contiguous()
    if x.dim() == 3:
        return x if (x.stride(-1) == 1 or x.shape[-1] <= 1) else x.contiguous()
    return x


def _positive_finite(x) -> bool:
    try:
        return math.isfinite(float(x)) and float(x) > 0
    except (TypeError, ValueError):
        return False


def _unsupported(return_intermediate_states: bool, cp_context, kwargs: Dict, use_graph: bool = False,
                 cu_seqlens_cpu=None, tokens: Optional[int] = None) -> List[str]:
    """Why flashkda's own backends (cuda, reference) cannot serve these flags of a chunk_kda call."""
    out = []
    if use_graph:
        # fla's graph mode pads cu_seqlens with empty sequences and may end it before the last token
        # (rows past it left undefined); flashkda's kernels treat cu_seqlens[N] != T as an input error,
        # recorded on the device in the call's workspace: the call would write nothing, unseen unless the
        # caller passed workspace= and reads it.
        out.append("argument 'use_graph=True' (fla's padded fixed-shape varlen mode, where cu_seqlens may end "
                   "before the last token) is not implemented")
    if (isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.dim() == 1
            and cu_seqlens_cpu.numel() > 0 and tokens is not None and int(cu_seqlens_cpu[-1]) != tokens):
        out.append(f"cu_seqlens_cpu ends at {int(cu_seqlens_cpu[-1])}, not at the {tokens} tokens of q: padded token "
                   "buffers are not implemented")
    if return_intermediate_states:
        out.append("argument 'return_intermediate_states=True' is not implemented (the kernels keep no "
                   "per-chunk states)")
    if cp_context is not None:
        out.append("argument 'cp_context' (context parallelism across devices) is not implemented")
    unknown = sorted(key for key in kwargs if key not in _SERVED_KWARGS)
    if unknown:
        out.append(f"unsupported keyword argument(s) {unknown} (flashkda serves fla's chunk_kda forward "
                   "without them)")
    return out


def _select(q, k, v, g, beta, A_log, dt_bias, initial_state, return_intermediate_states, cp_context,
            kwargs, backend, evaluate_all=False, use_graph=False, cu_seqlens_cpu=None) -> Selection:
    # The selection reads the tensors' devices, dtypes and shapes: anything else is named here.
    for name, t, layout in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, H, V]"),
                            ("g", g, "[B, T, H, K]"), ("beta", beta, "[B, T, H]")):
        host_checks.check_tensor(name, t, layout)
    host_checks.check_tensor("A_log", A_log, "[H]", optional=True)
    host_checks.check_tensor("dt_bias", dt_bias, "[H * K]", optional=True)
    host_checks.check_tensor("initial_state", initial_state, "[N, H, K, V]", optional=True)
    return select_backend(
        "prefill", q, k, v, backend=backend, fn="chunk_kda",
        tensors={"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                 "initial_state": initial_state},
        unsupported=_unsupported(return_intermediate_states, cp_context, kwargs, use_graph, cu_seqlens_cpu,
                                 q.shape[1] if q.dim() == 4 else None),
        evaluate_all=evaluate_all)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    *,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    backend: Optional[str] = None,
    workspace: Optional[Tensor] = None,
    **kwargs,
):
    """KDA prefill, fla-compatible: returns ``(o [B, T, H, V], final_state or None)``.

    q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` (bf16, K = V in {64, 128} for flashkda's own
    backends); g ``[B, T, H, K]``; beta ``[B, T, H]``; ``initial_state`` ``[N, H, K, V]``
    (``[N, H, V, K]`` if ``state_v_first``); ``cu_seqlens [N + 1]`` for varlen inputs (then B == 1).
    ``A_log [H]`` and ``dt_bias [H * K]`` feed the fused gate (``use_gate_in_kernel=True``).  See the
    module docstring for the mapping.  ``disable_recompute``, ``cu_seqlens_cpu`` and ``max_num_seqs`` have
    no effect on flashkda's backends (they never synchronise the host and are CUDA-graph safe as they are),
    except that a host ``cu_seqlens_cpu`` that ends before q's last token is not served; nor is
    ``use_graph=True`` (fla's padded mode, where ``cu_seqlens`` may end before the last token).

    ``backend``: ``None`` / ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"`` (module
    :mod:`flashkda.backend`); with ``"triton"`` every argument goes to fla's ``chunk_kda`` unchanged
    and its return value is returned.  ``workspace`` (keyword, flashkda's own; not passed to fla): a
    uint8 CUDA tensor of at least ``flashkda.get_workspace_size(...)`` bytes for the kernels, allocated
    per call when None (used by the "cuda" backend only; the others leave it as it was).  The kernels
    check the values of ``cu_seqlens`` on the device and, on a bad one, write nothing and record the
    error in the workspace: pass one to read it afterwards with :func:`flashkda.read_device_error`
    (without it the error, and the unwritten outputs, go unseen).
    """
    sel = _select(q, k, v, g, beta, A_log, dt_bias, initial_state, return_intermediate_states, cp_context,
                  kwargs, backend, use_graph=use_graph, cu_seqlens_cpu=cu_seqlens_cpu)
    if sel.backend is None:
        raise sel.error()
    if sel.backend == "triton":
        extra = dict(kwargs)
        if A_log is not None:
            extra["A_log"] = A_log
        if dt_bias is not None:
            extra["dt_bias"] = dt_bias
        return call_fla(
            "prefill", q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, use_graph=use_graph,
            max_num_seqs=max_num_seqs, **extra)
    return _flashkda_chunk_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens,
        A_log, dt_bias, kwargs,
        torch_reference=(sel.backend == "reference" and q.device.type != "cpu"), workspace=workspace)


def explain(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *args, **kwargs) -> Selection:
    """Which backend ``chunk_kda`` would use for these arguments, and why the others cannot serve them.

    Takes exactly the arguments of :func:`chunk_kda` (``backend=`` and ``FLASHKDA_BACKEND`` included),
    computes nothing, and returns a :class:`flashkda.backend.Selection`: ``.backend`` (None when no
    backend can serve the call), ``.reasons`` (backend -> None or why it was rejected), and a
    human-readable ``str()``.  Every backend is judged (fla is imported when the tensors are CUDA).
    """
    bound = inspect.signature(chunk_kda).bind(q, k, v, g, beta, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return _select(q, k, v, g, beta, a["A_log"], a["dt_bias"], a["initial_state"], a["return_intermediate_states"],
                   a["cp_context"], a["kwargs"], a["backend"], evaluate_all=True, use_graph=a["use_graph"],
                   cu_seqlens_cpu=a["cu_seqlens_cpu"])


def _flashkda_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                        state_v_first, cu_seqlens, A_log, dt_bias, kwargs, torch_reference=False, workspace=None):
    """chunk_kda on flashkda's backends: torch.ops.flashkda.prefill (CUDA kernels or C++ CPU reference),
    or, with ``torch_reference``, the float64 PyTorch reference on the tensors' device (slow)."""
    kwargs = dict(kwargs)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("flashkda.chunk_kda: pass either 'state_v_first' or the deprecated "
                             "'transpose_state_layout', not both")
        warnings.warn("'transpose_state_layout' is deprecated, use 'state_v_first'", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"flashkda.chunk_kda: argument 'chunk_size' must be 32 or 64, got {chunk_size}")

    # fla multiplies by the scale it is given; the ops read 0 as K^-0.5 and refuse negative values, so
    # the only scales both read alike are None and positive ones.
    if scale is not None and not _positive_finite(scale):
        raise host_checks.bad("scale", "None (K^-0.5) or a finite value > 0 (fla's chunk_kda would use it as "
                              "given; flashkda supports only positive scales or None)", repr(scale))

    # What this wrapper reads before the op (shapes, the sequence count) is checked here; the op
    # checks the rest.
    host_checks.check_rank("q", q, 4, "[B, T, H, K]")
    host_checks.check_rank("v", v, 4, "[B, T, H, V]")
    B, T, H, K = q.shape
    if cu_seqlens is not None:
        host_checks.check_tensor("cu_seqlens", cu_seqlens, "[N+1]")
        host_checks.check_rank("cu_seqlens", cu_seqlens, 1, "[N+1]")
        if cu_seqlens.shape[0] < 1:
            raise host_checks.bad("cu_seqlens", "at least 1 element [N+1]", str(list(cu_seqlens.shape)))
        if B != 1:
            raise ValueError(f"flashkda.chunk_kda: argument 'q': the batch size must be 1 with cu_seqlens "
                             f"(flatten varlen inputs), got {B}")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if initial_state is not None:
        layout = "[N, H, V, K]" if state_v_first else "[N, H, K, V]"
        host_checks.check_rank("initial_state", initial_state, 4, layout)
        expect = [N, H, v.shape[-1], K] if state_v_first else [N, H, K, v.shape[-1]]
        if list(initial_state.shape) != expect:
            raise host_checks.bad("initial_state", f"shape {expect} {layout.replace('[', '(').replace(']', ')')}: "
                                  "one state per sequence", str(list(initial_state.shape)))

    # Gate.
    A_log_t = dt_bias_t = None
    lb = -5.0
    if not use_gate_in_kernel:
        gate_mode = "precomputed"
    else:
        if safe_gate:
            if lower_bound is None:
                raise ValueError("flashkda.chunk_kda: argument 'lower_bound' must be given when "
                                 "safe_gate=True and use_gate_in_kernel=True")
            if not (-5.0 <= lower_bound < 0.0):
                raise ValueError(f"flashkda.chunk_kda: argument 'lower_bound' must be in [-5, 0), got "
                                 f"{lower_bound}")
        if lower_bound is not None:
            gate_mode, lb = "bounded", float(lower_bound)
        else:
            if A_log is None:
                raise ValueError("flashkda.chunk_kda: argument 'A_log' must be given when "
                                 "use_gate_in_kernel=True and lower_bound is not set")
            gate_mode = "softplus"
        if A_log is None:  # bounded gate without A_log: exp(A_log) = 1
            A_log_t = torch.zeros(H, dtype=torch.float32, device=q.device)
        else:
            A_log_t = A_log.to(dtype=torch.float32)
        if dt_bias is None:
            dt_bias_t = torch.zeros(H, K, dtype=torch.float32, device=q.device)
        else:
            dt_bias_t = dt_bias.to(dtype=torch.float32)

    # Beta.
    use_beta_sigmoid = bool(use_beta_sigmoid_in_kernel)
    if allow_neg_eigval:
        if not use_beta_sigmoid_in_kernel:
            raise ValueError("flashkda.chunk_kda: argument 'allow_neg_eigval=True' requires "
                             "use_beta_sigmoid_in_kernel=True")
        beta = 2.0 * torch.sigmoid(beta.float())  # beta in [0, 2), already activated
        use_beta_sigmoid = False
    if beta.dtype not in (torch.bfloat16, torch.float32):
        beta = beta.float()
    if g.dtype not in (torch.bfloat16, torch.float32):
        g = g.float()

    # States: the kernels' layout is V-first [N, H, V, K], contiguous.
    h0 = None
    if initial_state is not None:
        h0 = initial_state.contiguous() if state_v_first else initial_state.transpose(-1, -2).contiguous()
    ht = None
    if output_final_state:
        ht = torch.empty(N, H, v.shape[-1], K, dtype=torch.float32, device=q.device)

    if torch_reference:
        # Debugging path: the float64 recurrence on the tensors' device, results cast back.  It indexes
        # with cu_seqlens: its shapes and values are checked first, on a host copy (the path
        # synchronises anyway), with the op's rules.
        host_checks.token_layout(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        ref_out, ref_fs = _reference.prefill(
            q, k, v, g, beta, scale=scale, gate_mode=gate_mode, A_log=A_log_t, dt_bias=dt_bias_t, lower_bound=lb,
            use_qk_l2norm=bool(use_qk_l2norm_in_kernel), use_beta_sigmoid=use_beta_sigmoid, initial_state=h0,
            cu_seqlens=cu_seqlens)
        out = ref_out.to(v.dtype)
        if ht is not None:
            ht.copy_(ref_fs)
    else:
        q, k, v, g, beta = (_rows_contiguous(t) for t in (q, k, v, g, beta))
        out = _new_out(q, v)
        if workspace is None or q.device.type != "cuda":  # CPU calls need none
            workspace = new_workspace(q, cu_seqlens)
        torch.ops.flashkda.prefill(
            q, k, v, g, beta, out, workspace,
            **_op_options(scale, gate_mode, A_log_t, dt_bias_t, lb, use_qk_l2norm_in_kernel, use_beta_sigmoid),
            initial_state=h0,
            final_state=ht,
            cu_seqlens=cu_seqlens,
        )
    if ht is not None and not state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return out, ht
