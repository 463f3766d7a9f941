"""Backend selection for flashkda's entry points (``chunk_kda`` for prefill, ``decode`` for decode).

Three backends can compute a KDA call:

* ``"cuda"``: flashkda's sm_90a kernels (``torch.ops.flashkda.*``).  Needs CUDA tensors on a device of
  compute capability exactly 9.0 (H100, H200, H20), a CUDA build of flashkda, q/k/v in bfloat16,
  head dims K == V in {64, 128}, as many value heads as q/k heads, no autograd, and flags flashkda
  serves (for ``chunk_kda``: not ``return_intermediate_states``, not ``cp_context``, no unknown
  keyword arguments).
* ``"triton"``: fla's Triton kernels.  Prefill: ``fla.ops.kda.chunk_kda``, with the call passed
  through unchanged (fla returns ``(o, final_state)``).  Decode: ``fla.ops.kda.fused_recurrent_kda``
  on the gathered pool rows, written back by the wrapper (plain decode, 1-D indices, only; needs an
  fla whose ``fused_recurrent_kda`` takes ``A_log``, ``dt_bias``, ``use_gate_in_kernel``,
  ``use_beta_sigmoid_in_kernel``, ``lower_bound`` and ``state_v_first``).  Needs CUDA tensors and an
  importable ``fla``.
* ``"reference"``: flashkda's reference.  For CPU tensors, the C++ CPU implementation behind the same
  ops (float64 accumulation, same restrictions as ``"cuda"`` except the device).  For CUDA tensors,
  and only when asked for by name, the float64 pure-PyTorch reference (:mod:`flashkda.reference`,
  prefill and decode) run on the tensors' GPU, results cast back: slow (a Python loop over tokens, a
  host sync), for debugging.

``backend="auto"`` picks the first backend that can serve the call, in the order cuda, triton,
reference (the reference only for CPU tensors).  A backend asked for by name never falls back: when
it cannot serve the call the call raises ``NotImplementedError`` (an argument or flag the backend
does not implement) or ``RuntimeError`` (the machine: device, build, fla missing), with the reasons.

The environment variable ``FLASHKDA_BACKEND`` (``auto``, ``cuda``, ``triton`` or ``reference``,
case-insensitive) replaces ``backend=None`` and ``backend="auto"``; a backend named in the call wins
over it.  An invalid value raises ``ValueError`` on the first call that consults it.  Under
``torch.compile`` the variable, the device capability and fla's availability are read once, at trace
time.

:func:`select_backend` is generic over the kind of call (``"prefill"``, ``"decode"``): an entry point
describes its call (the main tensors, the tensors that may require grad, and the reasons flashkda's
own implementations, or fla's, cannot serve its flags) and gets a :class:`Selection`.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["ENV_VAR", "BACKENDS", "KINDS", "Selection", "select_backend", "resolve_request"]

Tensor = torch.Tensor

ENV_VAR = "FLASHKDA_BACKEND"
BACKENDS = ("cuda", "triton", "reference")
KINDS = ("prefill", "decode")
_CHOICES = ("auto",) + BACKENDS
_HEAD_DIMS = (64, 128)

# The flashkda op each kind runs (cuda and CPU reference), and fla's function for the triton backend.
_OWN_OPS = {"prefill": "prefill", "decode": "decode"}
_FLA_FUNCTIONS = {"prefill": ("fla.ops.kda", "chunk_kda"), "decode": ("fla.ops.kda", "fused_recurrent_kda")}
# Kinds the float64 PyTorch reference (flashkda.reference) can compute on CUDA tensors.
_TORCH_REFERENCE_KINDS = ("prefill", "decode")
# Arguments fla's function for a kind must name explicitly (an older fla swallows unknown keywords in
# **kwargs and would silently compute something else).
_FLA_REQUIRED_ARGS = {
    "prefill": (),
    "decode": ("A_log", "dt_bias", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "lower_bound",
               "state_v_first"),
}

_DESCRIPTIONS = {
    "cuda": "flashkda's sm_90a CUDA kernels",
    "triton": "fla's Triton kernels",
    "reference": "flashkda's reference",
}


@dataclass(frozen=True)
class Selection:
    """Which backend serves a call, and why the others cannot.

    ``backend``: the backend that serves the call, or None when none can.  ``requested``: ``"auto"``
    or the backend asked for; ``source``: where that request came from (``"default"``,
    ``"argument"`` or ``"FLASHKDA_BACKEND"``).  ``reasons[b]``: None when backend ``b`` can serve the
    call, else why not; backends that were not looked at (auto stops at the first usable one unless
    every backend is evaluated, as :func:`flashkda.explain` does) are absent.  ``str()`` gives a
    human-readable account.
    """

    kind: str
    fn: str
    backend: Optional[str]
    requested: str
    source: str
    device: str
    reasons: Dict[str, Optional[str]]
    not_implemented: Tuple[str, ...] = field(default=(), repr=False)  # rejected for a flag/argument

    @property
    def rejected(self) -> Dict[str, str]:
        return {b: r for b, r in self.reasons.items() if r is not None}

    def describe(self, backend: str) -> str:
        if backend == "reference":
            if self.device == "cuda":
                return "flashkda's float64 PyTorch reference on the GPU (slow, for debugging)"
            return "flashkda's C++ CPU implementation (float64 accumulation)"
        return _DESCRIPTIONS[backend]

    def __str__(self) -> str:
        head = f"flashkda.{self.fn} ({self.kind}, {self.device} tensors), "
        if self.requested == "auto":
            head += "backend auto" + (f" (from {ENV_VAR})" if self.source == ENV_VAR else "") + ": "
            if self.backend is None:
                head += "no backend can serve this call"
            else:
                head += f"'{self.backend}' ({self.describe(self.backend)})"
        else:
            src = "the backend= argument" if self.source == "argument" else ENV_VAR
            head += f"backend '{self.requested}' (asked for by {src}): "
            if self.backend is None:
                head += "cannot serve this call (no fallback)"
            else:
                head += self.describe(self.backend)
        lines = [head]
        for b in BACKENDS:
            if b not in self.reasons:
                continue
            r = self.reasons[b]
            if r is None:
                state = "selected" if b == self.backend else "usable"
            else:
                state = "rejected: " + r
            lines.append(f"  {b + ':':<10} {state}")
        return "\n".join(lines)

    def error(self) -> Exception:
        """The exception to raise when no backend serves the call (``backend is None``)."""
        if self.requested == "auto":
            msg = (f"flashkda.{self.fn}: no backend can serve this call (backend 'auto'; {self.device} "
                   "tensors):\n" + "\n".join(f"  {b}: {r}" for b, r in self.rejected.items()))
            feature = bool(self.not_implemented)
        else:
            src = "the backend= argument" if self.source == "argument" else f"environment variable {ENV_VAR}"
            msg = (f"flashkda.{self.fn}: backend '{self.requested}' (asked for by {src}) cannot serve this "
                   f"call: {self.reasons.get(self.requested)}")
            feature = self.requested in self.not_implemented
        msg += f"\n(flashkda.explain(...) with the same arguments shows how each backend was judged)"
        return NotImplementedError(msg) if feature else RuntimeError(msg)


# ---- facts about the machine, read once (constants under torch.compile) ----------------------------

@torch.compiler.assume_constant_result
def _env_value() -> str:
    return os.environ.get(ENV_VAR, "")


_capability_cache: Dict[int, Tuple[int, int]] = {}


@torch.compiler.assume_constant_result
def _device_capability(index: int) -> Tuple[int, int]:
    cc = _capability_cache.get(index)
    if cc is None:
        cc = tuple(torch.cuda.get_device_capability(index))
        _capability_cache[index] = cc
    return cc


@torch.compiler.assume_constant_result
def _current_device() -> int:
    return torch.cuda.current_device()


_built_with_cuda_cache: list = []


@torch.compiler.assume_constant_result
def _built_with_cuda() -> bool:
    if not _built_with_cuda_cache:
        try:
            _built_with_cuda_cache.append(bool(torch.ops.flashkda.built_with_cuda()))
        except (AttributeError, RuntimeError):
            _built_with_cuda_cache.append(False)
    return _built_with_cuda_cache[0]


_own_op_cache: Dict[str, bool] = {}


@torch.compiler.assume_constant_result
def _has_own_op(kind: str) -> bool:
    if kind not in _own_op_cache:
        _own_op_cache[kind] = hasattr(torch.ops.flashkda, _OWN_OPS[kind])
    return _own_op_cache[kind]


_fla_cache: Dict[Tuple[str, bool], str] = {}
_fla_functions: Dict[str, object] = {}  # kind -> fla's function, once imported


@torch.compiler.assume_constant_result
def _fla_problem(kind: str, do_import: bool) -> str:
    """'' when fla's function for `kind` is available, else why not.  Imports fla only if do_import."""
    key = (kind, do_import)
    if key not in _fla_cache:
        module, name = _FLA_FUNCTIONS[kind]
        try:
            found = importlib.util.find_spec("fla") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            why = "fla (flash-linear-attention, `pip install fla-core`) is not installed"
        elif not do_import:
            why = ""
        else:
            try:
                fn = getattr(importlib.import_module(module), name)
                why = ""
            except Exception as e:  # noqa: BLE001 (any import failure: triton missing, no GPU support, ...)
                why = f"fla is installed but `from {module} import {name}` failed: {type(e).__name__}: {e}"
            if not why:
                why = _fla_signature_problem(kind, f"{module}.{name}", fn)
                if not why:
                    _fla_functions[kind] = fn
        _fla_cache[key] = why
    return _fla_cache[key]


def _fla_signature_problem(kind: str, qualname: str, fn) -> str:
    """'' when `fn` names every argument flashkda passes it for `kind`, else what is missing."""
    required = _FLA_REQUIRED_ARGS[kind]
    if not required:
        return ""
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters
    except (TypeError, ValueError):
        return ""  # not introspectable: trust it
    missing = [a for a in required if a not in params]
    if missing:
        return (f"the installed fla's {qualname} has no argument(s) {missing} (an older fla); upgrade fla "
                "(`pip install -U fla-core`)")
    return ""


def _reset_caches() -> None:
    """Forget what was learnt about the machine (for tests that fake fla or the build)."""
    _capability_cache.clear()
    _built_with_cuda_cache.clear()
    _own_op_cache.clear()
    _fla_cache.clear()
    _fla_functions.clear()


# True while flashkda itself calls fla's function (the "triton" backend): flashkda's backend inside fla's
# own dispatch (flashkda.fla_backend) then declines, so fla runs its own kernels instead of calling back.
_FLA_SELF_CALL: contextvars.ContextVar = contextvars.ContextVar("flashkda_fla_self_call", default=False)


def in_fla_self_call() -> bool:
    """True inside :func:`call_fla` (flashkda's own call of fla's function)."""
    return bool(_FLA_SELF_CALL.get())


@torch.compiler.disable
def call_fla(kind: str, *args, **kwargs):
    """fla's function for `kind` called with these arguments, marked as flashkda's own call (see
    :func:`in_fla_self_call`).  fla's dispatch is outside torch.compile graphs anyway."""
    fn = fla_function(kind)
    token = _FLA_SELF_CALL.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _FLA_SELF_CALL.reset(token)


def fla_function(kind: str):
    """fla's function for `kind` (``fla.ops.kda.chunk_kda`` for prefill); raises if unavailable."""
    why = _fla_problem(kind, True)  # imports it once (selection already did for CUDA tensors)
    if why:
        raise RuntimeError(f"flashkda: backend 'triton': {why}")
    return _fla_functions[kind]


# ---- the request -------------------------------------------------------------------------------------

def _normalise(value: str, origin: str) -> str:
    v = value.strip().lower()
    if v not in _CHOICES:
        raise ValueError(f"flashkda: {origin} must be one of 'auto', 'cuda', 'triton', 'reference', got {value!r}")
    return v


def resolve_request(backend: Optional[str] = None) -> Tuple[str, str]:
    """``(requested, source)`` for a ``backend=`` argument, with ``FLASHKDA_BACKEND`` applied.

    A backend named in the argument wins; ``None`` / ``"auto"`` take the environment variable when it
    is set (and not empty), else ``"auto"``.  source: ``"argument"``, ``"FLASHKDA_BACKEND"`` or
    ``"default"``.
    """
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"flashkda: argument 'backend' must be a str or None, got {type(backend).__name__}")
        b = _normalise(backend, "argument 'backend'")
        if b != "auto":
            return b, "argument"
    env = _env_value()
    if env.strip():
        return _normalise(env, f"environment variable {ENV_VAR}"), ENV_VAR
    return "auto", ("argument" if backend is not None else "default")


# ---- the checks -------------------------------------------------------------------------------------

def _format_device(dev: torch.device) -> str:
    return dev.type if dev.index is None else f"{dev.type}:{dev.index}"


def _kernel_restrictions(q: Tensor, k: Tensor, v: Tensor) -> list:
    """What flashkda's kernels and C++ reference require of q, k, v (not the torch reference)."""
    out = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            out.append(f"argument '{name}': only bfloat16 is implemented, got {t.dtype}")
    K, V = q.shape[-1] if q.dim() > 0 else 0, v.shape[-1] if v.dim() > 0 else 0
    if K != V or K not in _HEAD_DIMS:
        out.append(f"argument 'q': expected head dim K == V in {{64, 128}}, got K={K}, V={V}")
    return out


def _common_restrictions(fn: str, q: Tensor, v: Tensor, tensors: Mapping[str, Optional[Tensor]],
                         unsupported: Sequence[str]) -> list:
    """What every flashkda implementation (kernels, C++ and PyTorch references) cannot do."""
    out = []
    if q.dim() == 4 and v.dim() == 4 and v.shape[2] != q.shape[2]:
        out.append(f"argument 'v': grouped value heads (HV={v.shape[2]} != H={q.shape[2]}) are not implemented")
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                out.append(f"flashkda: backward is not implemented (flashkda.{fn} is inference-only and argument "
                           f"'{name}' requires grad: call it under torch.no_grad() or torch.inference_mode(), or "
                           "detach the inputs)")
                break
    out.extend(unsupported)
    return out


def _check(backend: str, kind: str, fn: str, requested: str, q: Tensor, k: Tensor, v: Tensor,
           tensors: Mapping[str, Optional[Tensor]], unsupported: Sequence[str],
           triton_unsupported: Sequence[str] = ()) -> Tuple[list, list]:
    """(machine reasons, not-implemented reasons) why `backend` cannot serve the call; both empty: it can."""
    dev = q.device
    machine, feature = [], []
    if backend == "cuda":
        if dev.type != "cuda":
            machine.append(f"the tensors are on {_format_device(dev)}, not on a CUDA device")
        elif not _built_with_cuda():
            machine.append("this build of flashkda has no CUDA kernels (nvcc was not found when it was built)")
        else:
            index = dev.index if dev.index is not None else _current_device()
            cc = _device_capability(index)
            if cc != (9, 0):
                machine.append(f"cuda:{index} has compute capability {cc[0]}.{cc[1]}; the sm_90a kernels need "
                               "exactly 9.0 (H100, H200, H20)")
        if not _has_own_op(kind):
            machine.append(f"this build of flashkda has no op torch.ops.flashkda.{_OWN_OPS[kind]}")
        feature += _kernel_restrictions(q, k, v)
        feature += _common_restrictions(fn, q, v, tensors, unsupported)
    elif backend == "triton":
        if dev.type != "cuda":
            machine.append(f"fla's Triton kernels need CUDA tensors, got {_format_device(dev)}")
        why = _fla_problem(kind, dev.type == "cuda")
        if why:
            machine.append(why)
        feature += list(triton_unsupported)
    elif backend == "reference":
        if dev.type == "cpu":
            if not _has_own_op(kind):
                machine.append(f"this build of flashkda has no op torch.ops.flashkda.{_OWN_OPS[kind]}")
            feature += _kernel_restrictions(q, k, v)
            feature += _common_restrictions(fn, q, v, tensors, unsupported)
        elif dev.type == "cuda":
            if requested == "auto":
                machine.append("auto uses the reference for CPU tensors only (backend='reference' runs the "
                               "float64 PyTorch reference on the GPU: slow, for debugging)")
            elif kind not in _TORCH_REFERENCE_KINDS:
                machine.append(f"no PyTorch reference of {kind} for CUDA tensors")
            else:
                feature += _common_restrictions(fn, q, v, tensors, unsupported)
        else:
            machine.append(f"no reference for {_format_device(dev)} tensors (CPU and CUDA only)")
    else:  # pragma: no cover
        raise ValueError(f"unknown backend {backend!r}")
    return machine, feature


def select_backend(
    kind: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: Optional[str] = None,
    fn: Optional[str] = None,
    tensors: Optional[Mapping[str, Optional[Tensor]]] = None,
    unsupported: Sequence[str] = (),
    triton_unsupported: Sequence[str] = (),
    evaluate_all: bool = False,
) -> Selection:
    """Chooses the backend of one call of kind ``"prefill"`` or ``"decode"``.

    q, k, v: the call's main tensors (device, dtypes, head dims, heads).  ``backend``: ``None``,
    ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"`` (``FLASHKDA_BACKEND`` applies to None and
    "auto").  ``fn``: the entry point's name, for messages.  ``tensors``: named tensors checked for
    ``requires_grad`` (flashkda's implementations are inference-only).  ``unsupported``: reasons,
    found by the entry point, why flashkda's own implementations (cuda, reference) cannot serve the
    call's flags; ``triton_unsupported``: the same for fla's function (the "triton" backend).
    ``evaluate_all``: judge every backend (for explanations) instead of stopping at the
    chosen one.  Never raises for an unservable call: ``Selection.backend`` is None then, and
    ``Selection.error()`` is the exception to raise.
    """
    if kind not in KINDS:
        raise ValueError(f"flashkda: kind must be one of {KINDS}, got {kind!r}")
    fn = fn or ("chunk_kda" if kind == "prefill" else kind)
    tensors = {"q": q, "k": k, "v": v} if tensors is None else tensors
    requested, source = resolve_request(backend)
    order = BACKENDS if requested == "auto" else (requested,) + tuple(b for b in BACKENDS if b != requested)
    chosen = None
    reasons: Dict[str, Optional[str]] = {}
    not_implemented = []
    for b in order:
        if chosen is not None and not evaluate_all:
            break
        machine, feature = _check(b, kind, fn, requested, q, k, v, tensors, unsupported, triton_unsupported)
        if machine or feature:
            reasons[b] = "; ".join(machine + feature)
            if feature:
                not_implemented.append(b)
        else:
            reasons[b] = None
            if chosen is None and (requested == "auto" or b == requested):
                chosen = b
        if requested != "auto" and b == requested and chosen is None and not evaluate_all:
            break
    return Selection(kind=kind, fn=fn, backend=chosen, requested=requested, source=source,
                     device=q.device.type, reasons=reasons, not_implemented=tuple(not_implemented))
