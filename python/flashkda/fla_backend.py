"""flashkda as a backend of fla's own ``fla.ops.kda.chunk_kda`` (fla >= 0.6).

fla 0.6 dispatches ``chunk_kda`` through registered backends (``fla.backends``: each has a priority,
an availability check, an environment switch and a verifier that accepts or declines a call; fla's
Triton path runs when every backend declines).  :func:`register` adds flashkda to that list, so code
that already calls fla gets flashkda's sm_90a kernels for every call they serve, with no other change:

    import flashkda.fla_backend
    flashkda.fla_backend.register()        # once per process

    from fla.ops.kda import chunk_kda
    o, ht = chunk_kda(q, k, v, g, beta, ...)   # flashkda's kernels when they serve the call, else fla's

* The verifier accepts a call exactly when ``flashkda.chunk_kda(..., backend="cuda")`` serves it
  (:func:`flashkda.explain` with ``backend="cuda"`` says why not otherwise: CPU tensors, another GPU,
  gradients, grouped value heads, head dims, ``return_intermediate_states``, ``cp_context``, ...); a
  declined call goes on to fla's next backend and, last, fla's Triton kernels.  fla logs each
  backend's first acceptance and rejection at INFO level (logger ``fla.backends``).
* The call is then ``flashkda.chunk_kda`` with the same arguments: same return value and state layout
  as fla's function (``[N, H, K, V]``, or ``[N, H, V, K]`` with ``state_v_first=True``).  Should flashkda
  refuse it when checking it whole (strides, ranks, ranges the verifier does not look at: a
  ``ValueError`` or ``NotImplementedError`` before anything is written), fla's own implementation (the
  function behind its dispatch: fla's Triton path) runs it instead (logged once per reason, INFO, logger
  ``flashkda.fla_backend``).  ``A_log`` of shape ``[H, 1]`` / ``[1, 1, H, 1]`` is flattened first, as fla does.
* With fla's ``FLA_DISABLE_BACKEND_DISPATCH=1`` (read at fla's import) fla consults no backend:
  :func:`register` raises, :func:`registered` is False.
* ``priority`` (fla's convention: lower runs first) defaults to 2: before fla's own ``flash_kda``
  backend (priority 3, MoonshotAI's package, when installed).
* ``FLA_FLASHKDA=0`` in the environment disables it without unregistering (fla reads it per call).
* ``flashkda.chunk_kda(..., backend="triton")`` keeps meaning fla's own kernels: the verifier declines
  calls that flashkda itself makes to fla (:func:`flashkda.backend.call_fla`).

Decode: fla's serving entry ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (dispatched as
operation ``"kda"``) on a state pool: ``initial_state`` the pool ``[P, H, V, K]``
(``state_v_first=True``), ``inplace_final_state=True``, ``ssm_state_indices`` 1-D ``[N]`` or 2-D
``[N, S]`` with ``num_accepted_tokens``.  Those calls run :func:`flashkda.decode` (the same reads and
writes of the pool; a negative index is padding, where fla's kernel would read before the pool), and
return ``(out, initial_state)`` as fla does.  Declined: fla's other modes (no indices, per-sequence
initial / final states, ``[K, V]`` pools, 2-D indices without ``num_accepted_tokens``, per-channel
beta, ``allow_neg_eigval``, the softplus gate without ``A_log``), 1-D indices in the fixed layout with
T > 1 (fla then writes the states of a request's later tokens to the slots that follow its own;
flashkda writes the last one to its own slot: with 1-D indices flashkda serves one token a request,
and varlen calls are taken as such), and whatever ``flashkda.decode(..., backend="cuda")`` does not
serve.

Nothing here is imported by ``import flashkda``: fla is imported only by :func:`register`.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Optional, Tuple

import torch

from . import chunk as _chunk
from .decode import _select as _decode_select
from .decode import decode as _flashkda_decode
from .backend import in_fla_self_call

__all__ = ["BACKEND_TYPE", "ENV_VAR", "register", "unregister", "registered"]

BACKEND_TYPE = "flashkda"
ENV_VAR = "FLA_FLASHKDA"
_SERVING = ("cuda", "reference")  # flashkda backends that may serve fla's calls ("auto" could call fla back)
_DECODE_OPERATION = "kda"  # fla registers fused_recurrent_kda_fwd's backends under this operation name


_log = logging.getLogger(__name__)
_logged = set()


def _flat_A_log(A_log):
    """A_log with its size-1 dimensions dropped (fla reads it flat: [H, 1] or [1, 1, H, 1] mean [H])."""
    if isinstance(A_log, torch.Tensor) and A_log.dim() > 1 and A_log.numel() == max(A_log.shape):
        return A_log.reshape(-1)
    return A_log


def _fla_default(entry):
    """fla's own implementation behind its dispatch of `entry` (what fla runs when every backend declines)."""
    return inspect.unwrap(entry)


def _fall_back(what: str, entry, error: Exception, args, kwargs):
    """A call the verifier accepted but flashkda refused when checking it whole (ValueError /
    NotImplementedError, raised before anything is written): the function behind fla's dispatch (fla's
    Triton path, not another registered backend) runs it.  Logged once per distinct reason (INFO, logger
    flashkda.fla_backend)."""
    key = (what, type(error).__name__, re.sub(r"\d+", "#", str(error)))  # one reason, whatever the sizes
    if key not in _logged and len(_logged) < 256:
        _logged.add(key)
        _log.info("flashkda.fla_backend: %s falls back to fla's own kernels: %s: %s", what, type(error).__name__,
                  error)
    return _fla_default(entry)(*args, **kwargs)


def _fla():
    """fla's backend API and its chunk_kda; RuntimeError naming what is missing."""
    try:
        from fla import backends as fla_backends
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        import fla.ops.kda.fused_recurrent  # noqa: F401  (creates the "kda" operation's registry)
    except Exception as e:  # noqa: BLE001 (any import failure: fla missing, triton missing, ...)
        raise RuntimeError(f"flashkda.fla_backend: fla (flash-linear-attention >= 0.6, `pip install fla-core`) "
                           f"could not be imported: {type(e).__name__}: {e}") from e
    for name in ("BaseBackend", "register"):
        if not hasattr(fla_backends, name):
            raise RuntimeError(f"flashkda.fla_backend: the installed fla has no fla.backends.{name} (backend "
                               "dispatch came with fla 0.6); upgrade fla (`pip install -U fla-core`)")
    return fla_backends, fla_chunk_kda


class _Binder:
    """inspect.Signature.bind(...).arguments with defaults applied, for a signature of positional-or-keyword
    parameters, keyword-only ones and **kwargs, in ~1/10 of bind's time (the verifiers run on every
    call fla dispatches)."""

    def __init__(self, fn):
        params = inspect.signature(fn).parameters.values()
        self.positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        self.position = {name: i for i, name in enumerate(self.positional)}
        self.names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.defaults = {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                         and p.default is not p.empty}
        self.required = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty]

    def __call__(self, args, kwargs) -> dict:
        if len(args) > len(self.positional):
            raise TypeError(f"too many positional arguments ({len(args)})")
        a = dict(self.defaults)
        a.update(zip(self.positional, args))
        extra = {}
        for key, value in kwargs.items():
            if key in self.names:
                if self.position.get(key, len(args)) < len(args):
                    raise TypeError(f"multiple values for argument {key!r}")
                a[key] = value
            else:
                extra[key] = value
        missing = [name for name in self.required if name not in a]
        if missing:
            raise TypeError(f"missing argument(s) {missing}")
        a["kwargs"] = extra
        return a


_bind_chunk = _Binder(_chunk.chunk_kda)


def _scale_problem(scale) -> str:
    """fla uses any scale as given; flashkda reads 0 as K^-0.5 and refuses negative ones: only None and
    positive scales mean the same to both."""
    if scale is None or _chunk._positive_finite(scale):
        return ""
    return f"scale {scale!r}: flashkda serves None (K^-0.5) or a finite scale > 0"


def _lower_bound_problem(use_gate_in_kernel, lower_bound) -> str:
    """fla computes the bounded gate for any lower_bound; flashkda's kernels for [-5, 0) (the range that
    keeps their exponents safe)."""
    if not use_gate_in_kernel or lower_bound is None:
        return ""
    try:
        ok = -5.0 <= float(lower_bound) < 0.0
    except (TypeError, ValueError):
        ok = False
    return "" if ok else f"lower_bound {lower_bound!r}: flashkda serves the bounded gate for lower_bound in [-5, 0)"


def _judge(serving: str, args, kwargs) -> Tuple[bool, Optional[str]]:
    """(accepted, why not) for one call of fla's chunk_kda, served by flashkda backend `serving`."""
    if in_fla_self_call():
        return False, "flashkda.chunk_kda(backend='triton') asked for fla's own kernels"
    kwargs = {key: value for key, value in kwargs.items() if key != "backend"}
    a = _bind_chunk(args, kwargs)
    problem = _scale_problem(a["scale"]) or _lower_bound_problem(a["use_gate_in_kernel"], a["lower_bound"])
    if problem:
        return False, problem
    sel = _chunk._select(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["initial_state"],
                         a["return_intermediate_states"], a["cp_context"], a["kwargs"], serving,
                         use_graph=a["use_graph"], cu_seqlens_cpu=a["cu_seqlens_cpu"])
    if sel.backend == serving:
        return True, None
    return False, sel.reasons.get(serving) or f"flashkda backend {serving!r} cannot serve the call"


def _fla_decode_signature(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                          output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                          ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                          use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                          lower_bound=None, out=None, **kwargs):
    """fla 0.6's fused_recurrent_kda_fwd signature (bound to read a call's arguments)."""


_bind_decode = _Binder(_fla_decode_signature)


def _decode_call(args, kwargs):
    """(flashkda.decode's arguments, why flashkda cannot take the call) for one fused_recurrent_kda_fwd call."""
    a = _bind_decode(args, kwargs)
    extra = sorted(key for key in a["kwargs"] if key != "backend")
    idx, acc = a["ssm_state_indices"], a["num_accepted_tokens"]
    why = []
    if idx is None or a["initial_state"] is None or not a["inplace_final_state"]:
        why.append("only the state-pool mode is served (ssm_state_indices, initial_state the pool, "
                   "inplace_final_state=True)")
    if not a["state_v_first"]:
        why.append("only V-first pools [P, H, V, K] are served (state_v_first=True)")
    if a["allow_neg_eigval"]:
        why.append("allow_neg_eigval=True is not implemented")
    if extra:
        why.append(f"unsupported keyword argument(s) {extra}")
    for problem in (_scale_problem(a["scale"]), _lower_bound_problem(a["use_gate_in_kernel"], a["lower_bound"])):
        if problem:
            why.append(problem)
    beta, q = a["beta"], a["q"]
    if hasattr(beta, "dim") and hasattr(q, "dim") and beta.dim() != q.dim() - 1:
        why.append("per-channel beta [B, T, H, V] is not implemented")
    if hasattr(idx, "dim"):
        if idx.dim() == 2 and acc is None:
            why.append("2-D ssm_state_indices without num_accepted_tokens (fla reads slot 0) is not served")
        if idx.dim() == 1 and acc is not None:
            why.append("num_accepted_tokens with 1-D ssm_state_indices is not served")
        cu = a["cu_seqlens"]
        if idx.dim() == 1 and hasattr(q, "shape") and len(q.shape) == 4 and (
                (cu is None and q.shape[1] > 1) or (cu is not None and hasattr(cu, "shape") and len(cu.shape) == 1
                                                    and q.shape[1] > cu.shape[0] - 1)):
            why.append("1-D ssm_state_indices with T > 1 tokens a request: fla writes the later tokens' states "
                       "to the following slots, flashkda the last state to the request's own slot")
    if a["use_gate_in_kernel"]:
        if a["lower_bound"] is not None:
            gate_mode, lower_bound = "bounded", float(a["lower_bound"])
        else:
            gate_mode, lower_bound = "softplus", -5.0
            if a["A_log"] is None:
                why.append("the softplus gate without A_log (fla then uses -e softplus) is not served")
    else:
        gate_mode, lower_bound = "precomputed", -5.0
    call = None
    if not why:
        H, K = q.shape[2], q.shape[3]
        A_log, dt_bias = a["A_log"], a["dt_bias"]
        if gate_mode != "precomputed":  # an absent A_log / dt_bias (zeros) is filled in by _with_gate_defaults
            A_log = None if A_log is None else _flat_A_log(A_log).float()
            dt_bias = None if dt_bias is None else dt_bias.float().reshape(H, K)
        else:
            A_log = dt_bias = None
        call = dict(args=(a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"], idx, a["out"]),
                    kwargs=dict(num_accepted_tokens=acc, cu_seqlens=a["cu_seqlens"], scale=a["scale"],
                                gate_mode=gate_mode, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                use_qk_l2norm=bool(a["use_qk_l2norm_in_kernel"]),
                                use_beta_sigmoid=bool(a["use_beta_sigmoid_in_kernel"])))
    return call, "; ".join(why)


def _with_gate_defaults(call):
    """The decode op needs A_log and dt_bias for a fused gate: fla's absent ones are exp(A_log) = 1 and no
    bias, i.e. zeros.  Allocated here, for a call about to run, not in the verifier."""
    kw = call["kwargs"]
    if kw["gate_mode"] != "precomputed" and (kw["A_log"] is None or kw["dt_bias"] is None):
        q = call["args"][0]
        H, K = q.shape[2], q.shape[3]
        kw = dict(kw)
        if kw["A_log"] is None:
            kw["A_log"] = torch.zeros(H, dtype=torch.float32, device=q.device)
        if kw["dt_bias"] is None:
            kw["dt_bias"] = torch.zeros(H, K, dtype=torch.float32, device=q.device)
        call = dict(call, kwargs=kw)
    return call


def _judge_decode(serving: str, args, kwargs) -> Tuple[bool, Optional[str]]:
    """(accepted, why not) for one call of fla's fused_recurrent_kda_fwd, served by flashkda backend `serving`."""
    if in_fla_self_call():
        return False, "flashkda.decode(backend='triton') asked for fla's own kernels"
    call, why = _decode_call(args, kwargs)
    if why:
        return False, why
    q, k, v, g, beta, pool, idx, _ = call["args"]
    kw = call["kwargs"]
    sel = _decode_select(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], pool, idx, serving)
    if sel.backend == serving:
        return True, None
    return False, sel.reasons.get(serving) or f"flashkda backend {serving!r} cannot serve the call"


def register(priority: int = 2, backend: str = "cuda") -> None:
    """Registers flashkda as a backend of ``fla.ops.kda.chunk_kda`` and of fla's decode entry
    ``fused_recurrent_kda_fwd`` (operation "kda") in this process (again: replaces it).

    ``priority``: fla's order among its backends (lower first; fla's ``flash_kda`` backend is 3).
    ``backend``: which flashkda implementation serves the calls it accepts: ``"cuda"`` (the sm_90a
    kernels; the default) or ``"reference"`` (flashkda's reference: the C++ one for CPU tensors, the
    float64 PyTorch one for CUDA tensors; for debugging and tests).  Raises ``RuntimeError`` when fla
    (>= 0.6) cannot be imported, ``ValueError`` for a bad argument.
    """
    if backend not in _SERVING:
        raise ValueError(f"flashkda.fla_backend.register: argument 'backend' must be one of {_SERVING}, "
                         f"got {backend!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"flashkda.fla_backend.register: argument 'priority' must be an int, got {priority!r}")
    fla_backends, fla_chunk_kda = _fla()
    if _dispatch_disabled(fla_backends):
        raise RuntimeError("flashkda.fla_backend.register: fla's backend dispatch is off in this process "
                           "(FLA_DISABLE_BACKEND_DISPATCH=1 when fla was imported): fla runs its own kernels only")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode_fwd
    serving = backend

    class FlashKDABackend(fla_backends.BaseBackend):
        """flashkda for fla's chunk_kda and fused_recurrent_kda_fwd (registered by flashkda.fla_backend.register)."""

        backend_type = BACKEND_TYPE
        package_name = "flashkda"
        env_var = ENV_VAR
        default_enable = True

        def chunk_kda_verifier(self, *args, **kwargs):
            return _judge(serving, args, kwargs)

        def chunk_kda(self, *args, **kwargs):
            own = {key: value for key, value in kwargs.items() if key != "backend"}
            own["A_log"] = _flat_A_log(own.get("A_log"))  # fla flattens it too ([1, 1, H, 1] in SGLang)
            try:
                return _chunk.chunk_kda(*args, backend=serving, **own)
            except (ValueError, NotImplementedError) as e:
                return _fall_back("chunk_kda", fla_chunk_kda, e, args, kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return _judge_decode(serving, args, kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            try:
                call, why = _decode_call(args, kwargs)
                if why:  # the verifier accepted it: only a call made around fla's dispatch lands here
                    raise NotImplementedError(f"flashkda.fla_backend: {why}")
                call = _with_gate_defaults(call)
                out = _flashkda_decode(*call["args"], backend=serving, **call["kwargs"])
            except (ValueError, NotImplementedError) as e:
                return _fall_back("fused_recurrent_kda_fwd", fla_decode_fwd, e, args, kwargs)
            return out, call["args"][5]  # (out, the pool updated in place), as fla returns

    FlashKDABackend.priority = priority
    fla_backends.register(fla_chunk_kda)(FlashKDABackend)
    fla_backends.register(_DECODE_OPERATION)(FlashKDABackend)


def _dispatch_disabled(fla_backends) -> bool:
    """fla's FLA_DISABLE_BACKEND_DISPATCH=1 (read at its import): no backend is ever consulted."""
    return bool(getattr(fla_backends, "_DISPATCH_DISABLED", False))


def _registries():
    """fla's two registries flashkda registers in: chunk_kda's and the "kda" operation's ([] when fla's
    dispatch is off: there is nothing to register in)."""
    fla_backends, fla_chunk_kda = _fla()
    if _dispatch_disabled(fla_backends):
        return []
    functions = getattr(fla_backends, "_function_registries", None)
    operations = getattr(fla_backends, "_operation_registries", None)
    found = [functions.get(inspect.unwrap(fla_chunk_kda)) if isinstance(functions, dict) else None,
             operations.get(_DECODE_OPERATION) if isinstance(operations, dict) else None]
    if any(r is None or not isinstance(getattr(r, "_backends", None), dict) for r in found):
        raise RuntimeError("flashkda.fla_backend: this fla keeps its backends where flashkda cannot find them; "
                           f"set {ENV_VAR}=0 to disable flashkda's backend instead")
    return found


def registered() -> bool:
    """Whether flashkda is among the backends of fla's chunk_kda (and of its decode entry) in this process."""
    found = _registries()
    return bool(found) and all(BACKEND_TYPE in r._backends for r in found)


def unregister() -> None:
    """Removes flashkda from fla's backends (no-op when absent).  fla has no public call for this: it
    uses fla's registries (``fla.backends``), and raises ``RuntimeError`` if they moved
    (``FLA_FLASHKDA=0`` disables the backend through fla's own switch)."""
    for r in _registries():
        r._backends.pop(BACKEND_TYPE, None)
