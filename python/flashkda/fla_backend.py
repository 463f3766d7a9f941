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
  as fla's function (``[N, H, K, V]``, or ``[N, H, V, K]`` with ``state_v_first=True``).
* ``priority`` (fla's convention: lower runs first) defaults to 2: before fla's own ``flash_kda``
  backend (priority 3, MoonshotAI's package, when installed).
* ``FLA_FLASHKDA=0`` in the environment disables it without unregistering (fla reads it per call).
* ``flashkda.chunk_kda(..., backend="triton")`` keeps meaning fla's own kernels: the verifier declines
  calls that flashkda itself makes to fla (:func:`flashkda.backend.call_fla`).

Nothing here is imported by ``import flashkda``: fla is imported only by :func:`register`.
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

from . import chunk as _chunk
from .backend import in_fla_self_call

__all__ = ["BACKEND_TYPE", "ENV_VAR", "register", "unregister", "registered"]

BACKEND_TYPE = "flashkda"
ENV_VAR = "FLA_FLASHKDA"
_SERVING = ("cuda", "reference")  # flashkda backends that may serve fla's calls ("auto" could call fla back)
_SIGNATURE = inspect.signature(_chunk.chunk_kda)


def _fla():
    """fla's backend API and its chunk_kda; RuntimeError naming what is missing."""
    try:
        from fla import backends as fla_backends
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:  # noqa: BLE001 (any import failure: fla missing, triton missing, ...)
        raise RuntimeError(f"flashkda.fla_backend: fla (flash-linear-attention >= 0.6, `pip install fla-core`) "
                           f"could not be imported: {type(e).__name__}: {e}") from e
    for name in ("BaseBackend", "register"):
        if not hasattr(fla_backends, name):
            raise RuntimeError(f"flashkda.fla_backend: the installed fla has no fla.backends.{name} (backend "
                               "dispatch came with fla 0.6); upgrade fla (`pip install -U fla-core`)")
    return fla_backends, fla_chunk_kda


def _judge(serving: str, args, kwargs) -> Tuple[bool, Optional[str]]:
    """(accepted, why not) for one call of fla's chunk_kda, served by flashkda backend `serving`."""
    if in_fla_self_call():
        return False, "flashkda.chunk_kda(backend='triton') asked for fla's own kernels"
    kwargs = {key: value for key, value in kwargs.items() if key != "backend"}
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    sel = _chunk._select(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["initial_state"],
                         a["return_intermediate_states"], a["cp_context"], a["kwargs"], serving)
    if sel.backend == serving:
        return True, None
    return False, sel.reasons.get(serving) or f"flashkda backend {serving!r} cannot serve the call"


def register(priority: int = 2, backend: str = "cuda") -> None:
    """Registers flashkda as a backend of ``fla.ops.kda.chunk_kda`` in this process (again: replaces it).

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
    serving = backend

    class FlashKDABackend(fla_backends.BaseBackend):
        """flashkda's sm_90a kernels for fla's chunk_kda (registered by flashkda.fla_backend.register)."""

        backend_type = BACKEND_TYPE
        package_name = "flashkda"
        env_var = ENV_VAR
        default_enable = True

        def chunk_kda_verifier(self, *args, **kwargs):
            return _judge(serving, args, kwargs)

        def chunk_kda(self, *args, **kwargs):
            kwargs = {key: value for key, value in kwargs.items() if key != "backend"}
            return _chunk.chunk_kda(*args, backend=serving, **kwargs)

    FlashKDABackend.priority = priority
    fla_backends.register(fla_chunk_kda)(FlashKDABackend)


def _registry():
    fla_backends, fla_chunk_kda = _fla()
    registries = getattr(fla_backends, "_function_registries", None)
    registry = registries.get(inspect.unwrap(fla_chunk_kda)) if isinstance(registries, dict) else None
    if registry is None or not isinstance(getattr(registry, "_backends", None), dict):
        raise RuntimeError("flashkda.fla_backend: this fla keeps its backends where flashkda cannot find them; "
                           f"set {ENV_VAR}=0 to disable flashkda's backend instead")
    return registry


def registered() -> bool:
    """Whether flashkda is among the backends of fla's chunk_kda in this process."""
    return BACKEND_TYPE in _registry()._backends


def unregister() -> None:
    """Removes flashkda from the backends of fla's chunk_kda (no-op when absent).  fla has no public
    call for this: it uses fla's registry (``fla.backends``), and raises ``RuntimeError`` if that
    moved (``FLA_FLASHKDA=0`` disables the backend through fla's own switch)."""
    _registry()._backends.pop(BACKEND_TYPE, None)
