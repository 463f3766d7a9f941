"""Shared helpers of the Python tests: random KDA inputs and the float64 reference call."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from flashkda import reference as R

BF16 = torch.bfloat16
SENTINEL = 7.0


def cu_from_lens(lens: Sequence[int], dtype=torch.int32, device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)


def strided_copy(x: torch.Tensor, pad: int = 24, offset: int = 8) -> torch.Tensor:
    """The same values as ``x`` ([B, T, ...]) as a slice of a wider per-token row (row stride > row size)."""
    B, T = x.shape[0], x.shape[1]
    inner = x[0, 0].numel() if B * T > 0 else math.prod(x.shape[2:])
    buf = torch.full((B, T, inner + pad), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[:, :, offset:offset + inner].unflatten(2, x.shape[2:])
    view.copy_(x)
    return view


def make_inputs(
    lens: Optional[List[int]] = None,
    B: int = 1,
    T: int = 0,
    H: int = 2,
    D: int = 64,
    device="cpu",
    gate_mode: str = "bounded",
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    state_dtype=torch.float32,
    with_initial_state: bool = True,
    g_dtype=BF16,
    beta_dtype=BF16,
    cu_dtype=torch.int32,
    strided: bool = False,
    lower_bound: float = -5.0,
    generator: Optional[torch.Generator] = None,
) -> Dict:
    """Random inputs of kda_spec.md section 6 (lens -> varlen with B = 1; else B x T)."""
    gen = generator
    dev = torch.device(device)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)

    if lens is not None:
        B, T = 1, int(sum(lens))
        N = len(lens)
        cu = cu_from_lens(lens, cu_dtype, dev)
    else:
        N = B
        cu = None
    q = randn(B, T, H, D)
    k = randn(B, T, H, D)
    if not use_qk_l2norm:  # q, k given already normalised (else the delta rule is unstable)
        q, k = R.l2norm(q), R.l2norm(k)
    q, k = q.to(BF16), k.to(BF16)
    v = randn(B, T, H, D, dtype=BF16)
    if gate_mode == "precomputed":
        g = F.logsigmoid(randn(B, T, H, D) + 1.0).to(g_dtype)  # log decay in (-inf, 0)
    else:
        g = randn(B, T, H, D, dtype=g_dtype)
    beta = randn(B, T, H) if use_beta_sigmoid else rand(B, T, H)
    beta = beta.to(beta_dtype)
    A_log = rand(H)
    dt_bias = rand(H, D)
    h0 = (0.1 * randn(N, H, D, D)).to(state_dtype) if with_initial_state else None
    if strided:
        q, k, v, g, beta = (strided_copy(t) for t in (q, k, v, g, beta))
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                cu_seqlens=cu, gate_mode=gate_mode, use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid, lower_bound=lower_bound, N=N, H=H, D=D,
                state_dtype=state_dtype)


_OP_KEYS = ("gate_mode", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm", "use_beta_sigmoid",
            "initial_state", "cu_seqlens")


def op_kwargs(inp: Dict) -> Dict:
    return {key: inp[key] for key in _OP_KEYS}


def reference(inp: Dict, state_indices=None, has_initial_state=None, device=None, scale=None):
    return R.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=scale,
                     gate_mode=inp["gate_mode"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                     lower_bound=inp["lower_bound"], use_qk_l2norm=inp["use_qk_l2norm"],
                     use_beta_sigmoid=inp["use_beta_sigmoid"], initial_state=inp["initial_state"],
                     cu_seqlens=inp["cu_seqlens"], state_indices=state_indices,
                     has_initial_state=has_initial_state, device=device)


def new_outputs(inp: Dict, fill: float = SENTINEL, P: Optional[int] = None):
    q, v = inp["q"], inp["v"]
    out = torch.full(v.shape, fill, dtype=BF16, device=q.device)
    rows = inp["N"] if P is None else P
    fs = torch.full((rows, inp["H"], inp["D"], inp["D"]), fill, dtype=inp["state_dtype"], device=q.device)
    return out, fs


rel_err = R.rel_err
