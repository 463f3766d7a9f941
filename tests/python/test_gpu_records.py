"""chunk_prepare's chunk records against the float64 record model (record_oracle.py), tile by tile.

The end-to-end GPU tests judge the output and the final state; when they fail, this test says which
tile (KT, QT, KD, TB, MQK, gamma) of which (sequence, chunk, head) is off, which is what a change to
chunk_prepare (or its replacement) needs.  The records are read from the workspace after the call
(nothing after chunk_prepare writes them).  Tolerances are the tiles' storage precisions with margin
(bf16 KT / QT, fp16 KD / TB / MQK, fp32 gamma): a wrong tile is off by O(1), a right one by ~1e-3."""

import os

import pytest
import torch

import flashkda
from kda_helpers import BF16, make_inputs, op_kwargs
import record_oracle as O


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (sm_90a kernels)")]

DEV = "cuda"
# gamma: fp32, but 2^G_last of the kernel's fp32 gate and cumsum (~1e-6 relative a token) over 64 tokens.
# MQK: relative to its magnitude bound scale |q_i| |k_j| (record_oracle.compare_records).  A right tile
# is off by ~4e-5 of it with fp16 / tf32 operands (single entries, scripts/records_soak.py) and by an
# estimated ~2.5e-4 with bf16 off-diagonal factors (raw q, k: 2^-9 a factor over D terms); a wrong
# one by ~|q . k| / (|q| |k|) ~ 0.1.
TOL = {"KT": 1e-2, "QT": 1e-2, "KD": 5e-3, "TB": 5e-3, "MQK": 2e-3, "gamma": 1e-3}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


# The varlen case's sequence lengths (a one-token sequence included); scripts/records_soak.py soaks it.
VARLEN_LENS = [100, 17, 64, 131, 1]


def record_errors(inp, scale):
    """Runs the prefill on `inp` and compares every record it left with the model (compare_records)."""
    out = torch.full(inp["v"].shape, float("nan"), dtype=BF16, device=DEV)
    ws = flashkda.new_workspace(inp["q"], inp["cu_seqlens"])
    flashkda.prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, ws, scale=scale, **op_kwargs(inp))
    torch.cuda.synchronize()
    assert flashkda.read_device_error(ws) == 0
    return O.compare_records(ws, inp, scale)


def check_records(gen, inp, scale):
    worst = record_errors(inp, scale)
    assert set(worst) == set(TOL), worst
    bad = {name: w for name, w in worst.items() if not w[0] <= TOL[name]}
    assert not bad, f"seed {gen.initial_seed()}: tiles off (rel err, (sequence, chunk, head)): {bad}; all: {worst}"


@pytest.mark.parametrize("D", [64, 128])
def test_records_match_the_model_varlen(gen, D):
    inp = make_inputs(VARLEN_LENS, H=4, D=D, device=DEV, generator=gen)
    check_records(gen, inp, D ** -0.5)


@pytest.mark.parametrize("gate_mode,l2", [("softplus", True), ("precomputed", False), ("bounded", False)])
def test_records_match_the_model_modes(gen, gate_mode, l2):
    inp = make_inputs(B=2, T=90, H=2, D=128, device=DEV, gate_mode=gate_mode, use_qk_l2norm=l2, generator=gen)
    check_records(gen, inp, 0.2)
