"""Argument checks the Python layer makes itself, in the words of the ops' own checks.

The ops (``flashkda::can_implement`` / ``can_implement_decode`` behind ``torch.ops.flashkda.*``)
are the source of truth for what a call may be given: whatever reaches an op is judged there.
This module holds what cannot wait for an op:

* the message format of every argument error, :func:`bad`: ``flashkda: argument '<name>':
  expected <what>, got <what>``;
* ``scale`` for the paths that never reach an op (the float64 reference, fla's function);
* types and ranks of arguments a wrapper reads before calling the op (:func:`check_tensor`,
  :func:`check_rank`);
* the paths that run CUDA tensors without an op (backend ``"reference"``: the float64 PyTorch
  reference; backend ``"triton"``: fla's ``fused_recurrent_kda`` behind ``flashkda.decode``):
  :func:`token_layout` and :func:`decode_indices` check their shapes and index values with the
  ops' rules and messages, on host copies of the small index tensors.  Those paths copy and
  synchronise anyway (they are not graph-safe); without these checks a bad index is an IndexError,
  a device-side assert (which ends the process on CUDA) or a silently wrong result.
  Tests hold their verdicts against the CPU op's (tests/python/test_decode_cpu.py for decode,
  tests/python/test_backend.py for chunk_kda's reference path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

__all__ = ["bad", "check_scale", "check_tensor", "check_rank", "TokenLayout", "token_layout", "decode_indices"]

Tensor = torch.Tensor

_INDEX_DTYPES = (torch.int32, torch.int64)


def bad(name: str, expected: str, got: str) -> ValueError:
    """The error for argument ``name`` (to raise): the ops' wording."""
    return ValueError(f"flashkda: argument '{name}': expected {expected}, got {got}")


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_scale(scale) -> None:
    """``None`` or 0: ``K ** -0.5`` (the ops' convention); a positive finite value: as given.  A
    negative or non-finite one is an error (the ops reject it the same way)."""
    if scale is None:
        return
    expected = "a finite value > 0, or 0 for K^-0.5"
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise bad("scale", expected, repr(scale)) from None
    if not math.isfinite(s) or s < 0:
        raise bad("scale", expected, repr(s))


def check_tensor(name: str, t, layout: str, optional: bool = False) -> None:
    """``t`` is a tensor (or, when ``optional``, None); ``layout`` says what it should hold."""
    if isinstance(t, torch.Tensor) or (optional and t is None):
        return
    raise bad(name, f"a tensor {layout}" + (" or None" if optional else ""),
              "none" if t is None else type(t).__name__)


def check_rank(name: str, t: Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise bad(name, f"rank {rank} {layout}", f"rank {t.dim()} {_shape(t)}")


def _check_shape(name: str, t: Tensor, expected: Sequence[int], labels: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise bad(name, f"shape [{', '.join(str(s) for s in expected)}] {labels}", _shape(t))


def _check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise bad(name, "a floating-point dtype", _dtype_name(t.dtype))


def _index_values(name: str, t: Tensor, rank: int, layout: str) -> list:
    """The values of an int32 / int64 index tensor of rank ``rank``, as a host list (a copy)."""
    check_tensor(name, t, layout)
    check_rank(name, t, rank, layout)
    if t.dtype not in _INDEX_DTYPES:
        raise bad(name, "dtype int32 or int64", _dtype_name(t.dtype))
    return t.tolist()


def _extent(t: Tensor):
    """First and one-past-last byte ``t`` can touch (non-negative strides)."""
    lo = t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def _overlap(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    alo, ahi = _extent(a)
    blo, bhi = _extent(b)
    return alo < bhi and blo < ahi


@dataclass(frozen=True)
class TokenLayout:
    """The token tensors' dims and the sequence layout: R rows (dim 1), T logical tokens (the length
    of token_rows when given), N sequences; ``cu``: the host copy of cu_seqlens (None: fixed length)."""

    B: int
    R: int
    H: int
    K: int
    V: int
    T: int
    N: int
    cu: Optional[List[int]]

    def seq_len(self, n: int) -> int:
        return self.T if self.cu is None else self.cu[n + 1] - self.cu[n]


def token_layout(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, out: Optional[Tensor] = None,
                 cu_seqlens: Optional[Tensor] = None, token_rows: Optional[Tensor] = None) -> TokenLayout:
    """The ops' checks of the token tensors (shapes; any floating dtype), token_rows and cu_seqlens
    (values included), in their order and words, for a path that runs without an op."""
    check_tensor("q", q, "[B, T, H, K]")
    check_rank("q", q, 4, "[B, T, H, K]")
    _check_float("q", q)
    B, R, H, K = q.shape
    if H < 1:
        raise bad("q", "H >= 1 heads", f"H={H}")
    for name, t in (("k", k), ("v", v)):
        layout = "[B, T, H, K]" if name == "k" else "[B, T, H, V]"
        check_tensor(name, t, layout)
        check_rank(name, t, 4, layout)
        _check_float(name, t)
    V = v.shape[3]
    _check_shape("k", k, (B, R, H, K), "(B, T, H, K of q)")
    _check_shape("v", v, (B, R, H, V), "(B, T, H of q, V)")
    for name, t, rank, layout, dims, labels in (
            ("g", g, 4, "[B, T, H, K]", (B, R, H, K), "(B, T, H, K of q)"),
            ("beta", beta, 3, "[B, T, H]", (B, R, H), "(B, T, H of q)"),
            ("out", out, 4, "[B, T, H, V]", (B, R, H, V), "(B, T, H of q, V of v)")):
        if t is None and name == "out":
            continue
        check_tensor(name, t, layout)
        check_rank(name, t, rank, layout)
        _check_float(name, t)
        _check_shape(name, t, dims, labels)

    T = R
    if token_rows is not None:
        if cu_seqlens is None:
            raise bad("token_rows", "cu_seqlens to be given with it (the varlen layout, B == 1)", "no cu_seqlens")
        if B != 1:
            raise bad("token_rows", "B == 1 (the varlen layout: q of shape [1, R, H, K])", f"B={B}")
        rows = _index_values("token_rows", token_rows, 1, "[T] (one row per logical token)")
        T = len(rows)
        user = {}
        for t, r in enumerate(rows):
            if not 0 <= r < R:
                raise bad("token_rows", f"values in [0, {R}) (rows of dim 1 of q, k, v, g, beta and out)",
                          f"token_rows[{t}] = {r}")
            first = user.setdefault(r, t)
            if first != t:
                raise bad("token_rows", "distinct values (each row read and written by one token)",
                          f"token_rows[{t}] = token_rows[{first}] = {r}")

    cu = None
    N = B
    if cu_seqlens is not None:
        cu = _index_values("cu_seqlens", cu_seqlens, 1, "[N+1]")
        if not cu:
            raise bad("cu_seqlens", "at least 1 element [N+1]", _shape(cu_seqlens))
        if B != 1:
            raise bad("cu_seqlens", "B == 1 (q of shape [1, total_tokens, H, K]) when cu_seqlens is given",
                      f"B={B}")
        N = len(cu) - 1
        if N == 0 and T != 0:
            raise bad("cu_seqlens", f"at least 2 elements [N+1] for T = {T} tokens"
                      + (" (the length of token_rows)" if token_rows is not None else ""), _shape(cu_seqlens))
        if cu[0] != 0:
            raise bad("cu_seqlens", "cu_seqlens[0] == 0", str(cu[0]))
        for i in range(1, N + 1):
            if cu[i] < cu[i - 1]:
                raise bad("cu_seqlens", f"non-decreasing values, cu_seqlens[{i}] >= cu_seqlens[{i - 1}] = "
                          f"{cu[i - 1]}", f"cu_seqlens[{i}] = {cu[i]}")
        if cu[N] != T:
            raise bad("cu_seqlens", f"cu_seqlens[{N}] == T = {T}"
                      + (" (the length of token_rows)" if token_rows is not None else ""), str(cu[N]))
    return TokenLayout(B=B, R=R, H=H, K=K, V=V, T=T, N=N, cu=cu)


def decode_indices(lay: TokenLayout, out: Optional[Tensor], state_pool: Tensor, ssm_state_indices: Tensor,
                   num_accepted_tokens: Optional[Tensor]) -> None:
    """The decode op's checks of the pool, the indices and the accepted counts (values included:
    range, one write per pool row, no row written by one request and read by another), in its
    order and words, for a path that runs without the op."""
    H, K, V, N, T = lay.H, lay.K, lay.V, lay.N, lay.T
    check_tensor("state_pool", state_pool, "[P, H, V, K] float32/bfloat16")
    check_rank("state_pool", state_pool, 4, "[P, H, V, K]")
    _check_float("state_pool", state_pool)
    P = state_pool.shape[0]
    if P < 1 or tuple(state_pool.shape[1:]) != (H, V, K):
        raise bad("state_pool", f"shape [P, {H}, {V}, {K}] (P >= 1 pool rows, H, V, K)", _shape(state_pool))
    if out is not None and _overlap(out, state_pool):
        raise bad("out", "no memory shared with state_pool", "an overlap with state_pool")

    si = ssm_state_indices
    check_tensor("ssm_state_indices", si, "[N] or [N, S] int32/int64")
    if si.dim() not in (1, 2):
        raise bad("ssm_state_indices", "rank 1 [N] or rank 2 [N, S]", f"rank {si.dim()} {_shape(si)}")
    idx = _index_values("ssm_state_indices", si, si.dim(), "")
    spec = si.dim() == 2
    S = si.shape[1] if spec else 1
    if spec and lay.cu is not None:
        if si.shape[0] != N or S < 1:
            raise bad("ssm_state_indices", f"shape [{N}, S] (N requests, S >= 1 slots per request)", _shape(si))
    elif spec:
        _check_shape("ssm_state_indices", si, (N, T), "(N, T): one write slot per token")
        if N > 0 and S < 1:
            raise bad("ssm_state_indices",
                      "shape [N, T] with T >= 1 (one write slot per token, the read slot among them)", _shape(si))
    else:
        _check_shape("ssm_state_indices", si, (N,), "(N)")

    acc = None
    if spec:
        if num_accepted_tokens is None:
            raise bad("num_accepted_tokens", "a tensor [N] int32/int64 (required with 2-D ssm_state_indices)", "none")
        acc = _index_values("num_accepted_tokens", num_accepted_tokens, 1, "[N]")
        _check_shape("num_accepted_tokens", num_accepted_tokens, (N,), "(N)")
    elif num_accepted_tokens is not None:
        na = num_accepted_tokens
        raise bad("num_accepted_tokens", "none with 1-D ssm_state_indices (it selects the read slot of 2-D ones)",
                  f"a tensor {_shape(na)}" if isinstance(na, torch.Tensor) else type(na).__name__)

    def at(n, j):
        return f"ssm_state_indices[{n}, {j}]" if spec else f"ssm_state_indices[{n}]"

    rows = idx if spec else [[i] for i in idx]
    for n in range(N):
        for j in range(S):
            if rows[n][j] >= P:
                raise bad("ssm_state_indices", f"values < P = {P} (pool rows; negative values mean padding)",
                          f"{at(n, j)} = {rows[n][j]}")
    if spec:
        for n in range(N):
            if not 1 <= acc[n] <= S:
                raise bad("num_accepted_tokens", f"values in [1, {S}] (1 + accepted drafts; S = slots per request)",
                          f"num_accepted_tokens[{n}] = {acc[n]}")
    read = [rows[n][acc[n] - 1] if spec else rows[n][0] for n in range(N)]
    writer = {}  # pool row -> (request, column)
    for n in range(N):
        if read[n] < 0:
            continue  # padded: nothing read or written
        length = lay.seq_len(n)
        if spec and length > S:
            raise bad("ssm_state_indices", f"{length} write slots for request {n} (one per token)", f"{S} columns")
        for j in range(length if spec else 1):
            w = rows[n][j]
            if w < 0:
                continue  # skipped write
            prev = writer.setdefault(w, (n, j))
            if prev != (n, j):
                raise bad("ssm_state_indices",
                          "distinct non-negative write slots (each pool row written at most once per call)",
                          f"{at(n, j)} = {at(*prev)} = {w}")
    for n in range(N):
        m = writer.get(read[n]) if read[n] >= 0 else None
        if m is not None and m[0] != n:
            raise bad("ssm_state_indices", f"no pool row read by one request and written by another (request {n} "
                      f"reads row {read[n]})", f"row {read[n]} written by request {m[0]} ({at(*m)})")
