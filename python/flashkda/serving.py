"""``flashkda.serving``: one engine step of one KDA layer holding prefill, decode and spec-decode requests.

A serving engine's step mixes requests of three kinds in one flat token batch: new or continued
prompts (prefill), plain decode (one token per request) and speculative decode (1 + k draft tokens
per request, one pool slot per draft position).  :func:`kda_step` runs all of them on the step's
tensors as they are, writing every output directly at its row of ``out``: no gather of the inputs,
no temporaries, no merge copy, no host synchronisation, and no allocation when the workspace (and
``DecodeGroup.cu_seqlens``) are given, so a step of fixed shapes can be captured in a CUDA graph.

The step's tensors hold all R tokens of the step, in the engine's order:

* q, k, g ``[1, R, H, K]``, v and out ``[1, R, H, V]``, beta ``[1, R, H]`` (or the same without the
  leading 1: ``[R, H, D]`` / ``[R, H]``); dtypes, strides, gate modes and flags are those of
  :func:`flashkda.prefill`;
* ``state_pool [P, H, V, K]`` fp32 or bf16, V-first, contiguous: every request's recurrent state,
  read and written in place.

Each group says which rows of the step belong to it (``token_rows``, logical token t of the group
lives in row ``token_rows[t]``) and which pool rows its requests use:

* :class:`PrefillGroup`: ``token_rows [Tp]``, ``cu_seqlens [Np + 1]`` (request n owns the group's
  logical tokens ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1``), ``state_indices [Np]`` (pool row read
  and written; negative = padding: output rows zeroed, no state touched), ``has_initial_state
  [Np]`` bool (False: start from zeros), optional.  Runs ``torch.ops.flashkda.prefill`` with the
  pool as initial and final state.
* :class:`DecodeGroup`: ``token_rows [Nd]`` (one token per request), ``state_indices [Nd]``, and
  ``cu_seqlens [Nd + 1]`` = ``arange(Nd + 1)`` (give a persistent one to stay allocation-free; built
  when None).  Runs ``torch.ops.flashkda.decode`` with 1-D indices.
* :class:`SpecGroup`: ``token_rows [Ts]``, ``cu_seqlens [Ns + 1]``, ``state_indices [Ns, S]``
  (S = 1 + num_spec slots; request n reads ``state_indices[n, num_accepted_tokens[n] - 1]`` and
  writes the state after its t-th token to ``state_indices[n, t]``), ``num_accepted_tokens [Ns]``.
  Runs ``torch.ops.flashkda.decode`` with 2-D indices.

``token_rows=None`` (any group) means that the group's tokens are all R rows of the step, in order:
a step of that one group, as an engine without speculative decoding has in a pure prefill or pure
decode step.  Rows of ``out`` that no group names are left untouched.  The groups must not share rows of the step
nor pool rows (checked on the host for CPU tensors; on CUDA the engine's responsibility, each call
checks its own indices on the device).

Workspace (CUDA): one uint8 buffer of :func:`step_workspace_size` bytes, sized once for the largest
step (it only depends on the prefill token and sequence counts and H), reused by every layer and
step.  Each group gets its own region, so :func:`read_step_errors` reports the device-side
verdict of each of the three calls of the last step.  CPU calls need none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from . import host_checks
from .ops import _check_no_grad, _op_options, get_decode_workspace_size, get_workspace_size, read_device_error

__all__ = [
    "PrefillGroup",
    "DecodeGroup",
    "SpecGroup",
    "kda_step",
    "step_workspace_size",
    "new_step_workspace",
    "read_step_errors",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class PrefillGroup:
    """Prefill requests of a step: ``token_rows [Tp]``, ``cu_seqlens [Np + 1]`` (over the group's
    logical tokens), ``state_indices [Np]`` (negative = padding), ``has_initial_state [Np]`` bool."""

    token_rows: Optional[Tensor]
    cu_seqlens: Tensor
    state_indices: Tensor
    has_initial_state: Optional[Tensor] = None


@dataclass(frozen=True)
class DecodeGroup:
    """Plain decode requests of a step, one token each: ``token_rows [Nd]``, ``state_indices [Nd]``
    (negative = padding), ``cu_seqlens [Nd + 1] = arange(Nd + 1)`` (built, an allocation, when None)."""

    token_rows: Optional[Tensor]
    state_indices: Tensor
    cu_seqlens: Optional[Tensor] = None


@dataclass(frozen=True)
class SpecGroup:
    """Speculative-decode requests of a step: ``token_rows [Ts]``, ``cu_seqlens [Ns + 1]``,
    ``state_indices [Ns, S]`` (one pool slot per draft position), ``num_accepted_tokens [Ns]``."""

    token_rows: Optional[Tensor]
    cu_seqlens: Tensor
    state_indices: Tensor
    num_accepted_tokens: Tensor


# ---- the workspace: [decode region | spec region | prefill workspace] ------------------------------

_ALIGN = 512  # every region starts at a multiple of this from the buffer's start


def _region_bytes() -> int:
    n = get_decode_workspace_size()
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def step_workspace_size(max_prefill_tokens: int, num_heads: int, max_prefill_seqs: int = 1) -> int:
    """Bytes of workspace :func:`kda_step` needs on CUDA for steps of at most ``max_prefill_tokens``
    prefill tokens in ``max_prefill_seqs`` prefill requests, ``num_heads`` heads (any decode / spec
    group).  Monotone in every argument; CPU steps need none."""
    return 2 * _region_bytes() + get_workspace_size(max_prefill_tokens, num_heads, max(int(max_prefill_seqs), 1))


def new_step_workspace(max_prefill_tokens: int, num_heads: int, max_prefill_seqs: int = 1,
                       device="cuda") -> Tensor:
    """A uint8 workspace of :func:`step_workspace_size` bytes on ``device`` (contents need no init)."""
    return torch.empty(step_workspace_size(max_prefill_tokens, num_heads, max_prefill_seqs), dtype=torch.uint8,
                       device=device)


def _regions(workspace: Tensor):
    r = _region_bytes()
    return workspace[:r], workspace[r:2 * r], workspace[2 * r:]


def read_step_errors(workspace: Tensor) -> Dict[str, int]:
    """The device-side input errors of the last :func:`kda_step` that used ``workspace``, per group:
    ``{"prefill": code, "decode": code, "spec": code}`` (0 = none; :data:`flashkda.DEVICE_ERRORS`
    names the codes).  Synchronises the stream: for debugging and validation runs, not hot paths."""
    if workspace.device.type != "cuda":
        return {"prefill": 0, "decode": 0, "spec": 0}
    dec, spec, pre = _regions(workspace)
    return {"prefill": read_device_error(pre), "decode": read_device_error(dec), "spec": read_device_error(spec)}


# ---- host checks of CPU index tensors across groups --------------------------------------------------

def _check_groups_cpu(R: int, prefill: Optional[PrefillGroup], decode: Optional[DecodeGroup],
                      spec: Optional[SpecGroup]) -> None:
    """No row of the step and no pool row used by two groups (each op checks its own group; index
    tensors of an unexpected rank are left to it)."""
    row_owner: Dict[int, str] = {}
    pool_owner: Dict[int, str] = {}

    def claim(owner: Dict[int, str], key: int, who: str, what: str) -> None:
        other = owner.setdefault(key, who)
        if other != who:
            raise ValueError(f"flashkda: argument '{who}': expected {what} not used by another group, got {key} "
                             f"also used by '{other}'")

    def rank(t, r):
        return isinstance(t, torch.Tensor) and t.dim() == r

    groups = (("prefill", prefill), ("decode", decode), ("spec", spec))
    for name, grp in groups:
        if grp is None:
            continue
        if grp.token_rows is None:  # all rows of the step
            for r in range(R):
                claim(row_owner, r, name, "token rows (rows of the step)")
        elif rank(grp.token_rows, 1):
            for r in grp.token_rows.tolist():
                claim(row_owner, int(r), name, "token rows (rows of the step)")
    for name, grp in groups[:2]:
        if grp is not None and rank(grp.state_indices, 1):
            for s in grp.state_indices.tolist():
                if s >= 0:
                    claim(pool_owner, int(s), name, "pool rows")
    if (spec is not None and rank(spec.state_indices, 2) and rank(spec.num_accepted_tokens, 1)
            and rank(spec.cu_seqlens, 1) and spec.cu_seqlens.shape[0] == spec.state_indices.shape[0] + 1
            and spec.num_accepted_tokens.shape[0] == spec.state_indices.shape[0]):
        idx = spec.state_indices.tolist()
        acc = spec.num_accepted_tokens.tolist()
        cu = spec.cu_seqlens.tolist()
        for n, row in enumerate(idx):
            if not 1 <= acc[n] <= len(row) or row[acc[n] - 1] < 0:
                continue  # padded (or invalid: the op reports it)
            used = {row[acc[n] - 1]} | {s for s in row[:cu[n + 1] - cu[n]] if s >= 0}
            for s in used:
                claim(pool_owner, int(s), "spec", "pool rows")


# ---- every group validated before any runs ---------------------------------------------------------
#
# Each group is one op call, and an op checks all its arguments before it writes anything; but a
# later group's call would check its own only after the earlier groups' calls wrote out and the pool.
# So with more than one group every group's arguments are first judged by the op's own checks alone
# (torch.ops.flashkda.prefill_check / decode_check: can_implement, for CPU tensors the index values
# too; nothing runs).  The ops stay the one judge of their arguments.  Cost: one host-side check per
# group in eager steps (a captured CUDA graph replays the kernels alone).

# The kda_step name of each op argument a group's call is given (an op's message names its own
# arguments); the shared ones (q, k, v, g, beta, out, state_pool, A_log, scale, ...) keep theirs.
_NAMES = {
    "prefill": {"initial_state": "state_pool", "final_state": "state_pool", "cu_seqlens": "prefill.cu_seqlens",
                "state_indices": "prefill.state_indices", "has_initial_state": "prefill.has_initial_state",
                "token_rows": "prefill.token_rows"},
    "decode": {"ssm_state_indices": "decode.state_indices", "cu_seqlens": "decode.cu_seqlens",
               "token_rows": "decode.token_rows"},
    "spec": {"ssm_state_indices": "spec.state_indices", "num_accepted_tokens": "spec.num_accepted_tokens",
             "cu_seqlens": "spec.cu_seqlens", "token_rows": "spec.token_rows"},
}
_NAME_PATTERNS = {group: re.compile(r"\b(" + "|".join(names) + r")\b") for group, names in _NAMES.items()}
_OP_ERRORS = (ValueError, NotImplementedError, RuntimeError)  # what the ops raise (kInvalidArgument, ...)


def _in_step_terms(e: Exception, group: str) -> Exception:
    """The op error ``e`` of ``group``'s call, naming kda_step's arguments (``state_pool``,
    ``spec.num_accepted_tokens``, ...) instead of the op's, and the group where the argument is shared."""
    names = _NAMES[group]
    msg = _NAME_PATTERNS[group].sub(lambda m: names[m.group(1)], str(e))
    named = re.match(r"flashkda: argument '([^']*)'", msg)
    if named is None or "." not in named.group(1):
        msg += f" (in kda_step's {group} group)"
    return type(e)(msg)


def _call(group: str, call) -> None:
    """``group``'s op call (a run or a check), its errors in kda_step's terms."""
    if torch.compiler.is_compiling():  # traced: the fake kernels raise nothing
        call()
        return
    try:
        call()
    except _OP_ERRORS as e:
        if type(e) not in _OP_ERRORS:  # (a subclass, e.g. out of memory: not an argument error)
            raise
        raise _in_step_terms(e, group) from None


# ---- the step ---------------------------------------------------------------------------------------

def _tokens(group, q: Tensor) -> int:
    """The group's logical token count (host-known: a shape; a token_rows of another rank is the op's
    to report)."""
    rows = group.token_rows
    return rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() == 1 else q.shape[1]


def _sequences(group) -> int:
    cu = group.cu_seqlens
    return max(cu.shape[0] - 1, 1) if isinstance(cu, torch.Tensor) and cu.dim() == 1 else 1


def kda_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    out: Tensor,
    state_pool: Tensor,
    *,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: float = -5.0,
    scale: Optional[float] = None,
    gate_mode: str = "bounded",
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    workspace: Optional[Tensor] = None,
    prefill: Optional[PrefillGroup] = None,
    decode: Optional[DecodeGroup] = None,
    spec: Optional[SpecGroup] = None,
) -> Tensor:
    """One engine step of one KDA layer (see the module docstring); returns ``out``.

    q, k, g ``[1, R, H, K]``, v ``[1, R, H, V]``, beta ``[1, R, H]``, out ``[1, R, H, V]`` bf16 (or
    ``[R, ...]`` without the leading 1), ``state_pool [P, H, V, K]``; the gate and flags are those of
    :func:`flashkda.prefill` (``scale=None``: ``K ** -0.5``).  ``prefill``, ``decode``, ``spec``: the
    groups of the step (any may be None).  Every output lands in ``out`` at its row; the pool rows of
    the requests are updated in place.  ``workspace``: CUDA only, a contiguous uint8 tensor of at
    least :func:`step_workspace_size` bytes (allocated when None).  Errors: ``ValueError`` naming
    kda_step's argument (``state_pool``, ``decode.state_indices``, ...; a shared one with its group),
    raised before anything is written: every group is validated before the first runs (not under
    ``torch.compile``, where each group's call validates only its own arguments).
    """
    for name, t, layout in (("q", q, "[1, R, H, K]"), ("k", k, "[1, R, H, K]"), ("v", v, "[1, R, H, V]"),
                            ("g", g, "[1, R, H, K]"), ("beta", beta, "[1, R, H]"), ("out", out, "[1, R, H, V]"),
                            ("state_pool", state_pool, "[P, H, V, K]")):
        host_checks.check_tensor(name, t, layout)
    _check_no_grad("kda_step", q, k, v, g, beta, A_log, dt_bias, state_pool)
    result = out
    if q.dim() == 3:  # [R, H, D]: the engine's flat token layout (views, no copies)
        for name, t, rank, layout in (("k", k, 3, "[R, H, K]"), ("v", v, 3, "[R, H, V]"), ("g", g, 3, "[R, H, K]"),
                                      ("beta", beta, 2, "[R, H]"), ("out", out, 3, "[R, H, V]")):
            host_checks.check_rank(name, t, rank, layout + " (the flat layout of q)")
        q, k, v, g, out = (x.unsqueeze(0) for x in (q, k, v, g, out))
        beta = beta.unsqueeze(0)
    on_cuda = q.device.type == "cuda"

    # Workspace regions (CUDA); CPU calls need none.
    ws_decode = ws_spec = None
    ws_prefill = torch.empty(0, dtype=torch.uint8, device=q.device) if not on_cuda else None
    if on_cuda:
        Tp = _tokens(prefill, q) if prefill is not None else 0
        Np = _sequences(prefill) if prefill is not None else 1
        if workspace is None:
            workspace = new_step_workspace(Tp, q.shape[2], Np, device=q.device)
        if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous():
            raise ValueError("flashkda: argument 'workspace': expected a contiguous 1-D uint8 tensor "
                             f"(flashkda.serving.new_step_workspace), got dtype {workspace.dtype}, shape "
                             f"{tuple(workspace.shape)}")
        # Without a prefill group the prefill region still holds its error header (cleared below,
        # read by read_step_errors): the decode workspace is exactly that header.
        need = (step_workspace_size(Tp, q.shape[2], Np) if prefill is not None else
                2 * _region_bytes() + get_decode_workspace_size())
        if workspace.numel() < need:
            raise ValueError(f"flashkda: argument 'workspace': expected at least {need} bytes "
                             f"(flashkda.serving.step_workspace_size), got {workspace.numel()} bytes")
        ws_decode, ws_spec, ws_prefill = _regions(workspace)

    opts = _op_options(scale, gate_mode, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid)

    # The groups' calls: (group, run on its workspace region, the op's checks alone).
    calls = []
    if prefill is not None:
        pre = dict(initial_state=state_pool, final_state=state_pool, cu_seqlens=prefill.cu_seqlens,
                   state_indices=prefill.state_indices, has_initial_state=prefill.has_initial_state,
                   token_rows=prefill.token_rows, **opts)
        calls.append(("prefill", lambda: torch.ops.flashkda.prefill(q, k, v, g, beta, out, ws_prefill, **pre),
                      lambda: torch.ops.flashkda.prefill_check(q, k, v, g, beta, out, **pre)))
    if decode is not None:
        cu = decode.cu_seqlens
        if cu is None:
            cu = torch.arange(_tokens(decode, q) + 1, dtype=torch.int32, device=q.device)
        dec = dict(cu_seqlens=cu, token_rows=decode.token_rows, **opts)
        calls.append(("decode", lambda: torch.ops.flashkda.decode(
                          q, k, v, g, beta, out, state_pool, decode.state_indices, workspace=ws_decode, **dec),
                      lambda: torch.ops.flashkda.decode_check(
                          q, k, v, g, beta, out, state_pool, decode.state_indices, **dec)))
    if spec is not None:
        spc = dict(num_accepted_tokens=spec.num_accepted_tokens, cu_seqlens=spec.cu_seqlens,
                   token_rows=spec.token_rows, **opts)
        calls.append(("spec", lambda: torch.ops.flashkda.decode(
                          q, k, v, g, beta, out, state_pool, spec.state_indices, workspace=ws_spec, **spc),
                      lambda: torch.ops.flashkda.decode_check(
                          q, k, v, g, beta, out, state_pool, spec.state_indices, **spc)))

    # One group's call validates itself before it writes; with more, all are validated first, then
    # (host tensors) that no two share a row of the step or a pool row.
    if len(calls) > 1 and not torch.compiler.is_compiling():
        for group, _, check in calls:
            _call(group, check)
        if not on_cuda:
            _check_groups_cpu(q.shape[1], prefill, decode, spec)

    if on_cuda:
        # Each op clears its own error word; clear those of the groups this step does not run, so that
        # read_step_errors() reports this step alone (an async memset: graph-safe, no host sync).
        for grp, ws in ((prefill, ws_prefill), (decode, ws_decode), (spec, ws_spec)):
            if grp is None:
                torch.ops.flashkda.clear_device_error(ws)
    for group, run, _ in calls:
        _call(group, run)
    return result
