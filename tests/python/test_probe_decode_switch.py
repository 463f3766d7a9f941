"""bench/probe_decode_switch.py refuses a malformed --switch before it touches a GPU (CPU only): a typo in a
device call's command line must cost seconds of its time, not a sweep that times nothing."""

import os
import subprocess
import sys

import pytest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _probe(*args):
    return subprocess.run([sys.executable, "bench/probe_decode_switch.py", *args], cwd=_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("switch", ["FLASHKDA_DECODE_PREFETCH", "FLASHKDA_DECODE_PREFETCH=8",
                                    "DECODE_PREFETCH=0,8", "FLASHKDA_DECODE_PREFETCH=0,"])
def test_malformed_switch_is_refused_by_name(switch):
    pytest.importorskip("flashkda")  # the probe imports the package (and torch) before it parses
    r = _probe("--switch", switch, "--Ns", "4")
    assert r.returncode != 0
    assert "--switch: expected FLASHKDA_<NAME>=<value>,<value>" in r.stderr, r.stderr
    assert repr(switch) in r.stderr
    assert "copy bandwidth" not in r.stdout  # refused before the first measurement
