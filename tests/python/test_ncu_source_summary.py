"""scripts/ncu_source_summary.py: the pipe classes and the per-segment pipe demand (CPU only)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ncu_source_summary.py")
_spec = importlib.util.spec_from_file_location("ncu_source_summary", _PATH)
nss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nss)


@pytest.mark.parametrize("opcode,pipe", [("FFMA.FTZ", "fma"), ("IMAD.WIDE.U32", "fma"), ("MUFU.EX2", "xu"),
                                         ("HMMA.16816.F32", "tensor"), ("LDS.64", "lsu"),
                                         ("LDGSTS.E.BYPASS.128", "lsu"), ("IADD3", "alu"), ("LOP3.LUT", "alu"),
                                         ("BAR.SYNC.DEFER_BLOCKING", None), ("BRA", None)])
def test_pipe_of(opcode, pipe):
    assert nss.pipe_of(opcode) == pipe


def test_pipe_demand_against_the_segment_time():
    # A segment that took 10% of 1000 cycles on 2 SMs (100 SM cycles each) and issued 400 FFMA
    # (4 an SM cycle: 50 cycles an SM), 100 MUFU (0.5 a cycle: 100 cycles an SM) and 50 wavefronts.
    d = nss.pipe_demand({"fma": 400.0, "xu": 100.0}, 50.0, 0.10, 1000.0, 2)
    assert d["fma"] == pytest.approx(0.5)
    assert d["xu"] == pytest.approx(1.0)
    assert d["lsu"] == pytest.approx(0.25)
    assert d["alu"] == 0.0 and d["tensor"] == 0.0
    assert all(v == 0.0 for v in nss.pipe_demand({"fma": 1.0}, 1.0, 0.0, 1000.0, 2).values())
