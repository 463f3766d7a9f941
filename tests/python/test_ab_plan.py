"""scripts/ab_bench.sh PLAN=1: the expected duration of a device call, printed before any build (CPU only)."""

import os
import shutil
import subprocess

import pytest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _plan(tmp_path, **env):
    e = dict(os.environ, OUT=str(tmp_path), PLAN="1", **env)
    r = subprocess.run(["bash", "scripts/ab_bench.sh"], cwd=_ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_plan_matches_a_measured_call(tmp_path):
    # docs/runs/2026-12-05e/qt-six-warps: this call took 132 s.
    out = _plan(tmp_path, TESTS="1", VARIANTS="prepare-qt-six-warps", SANITIZE_VARIANTS="prepare-qt-six-warps",
                CASES="0,3,7", ROUNDS="2")
    assert "plan: 2 builds, 1 test runs, 1 x 2 sanitizer runs, 2 x 2 x 3 timed runs: ~140 s" in out
    assert "split" not in out
    assert not any(n.startswith("ab_") and n.endswith(".json") for n in os.listdir(tmp_path))  # nothing ran


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_plan_warns_when_a_call_would_run_out(tmp_path):
    out = _plan(tmp_path, TESTS="1", VARIANTS="a b c d e f g", SANITIZE_VARIANTS="a b c d e f g",
                CASES="0,1,2,3,4,5", ROUNDS="3")
    assert "split the variants over two calls" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_plan_counts_the_base_tests_when_asked(tmp_path):
    # TEST_BASE=1 tests main's own build too: one test run more than the variants (20 s in the estimate).
    args = dict(TESTS="1", VARIANTS="decode-read-burst", SANITIZE_VARIANTS="decode-read-burst", CASES="4,5,6,7",
                ROUNDS="3", BENCH="decode")
    assert "1 test runs" in _plan(tmp_path, **args)
    out = _plan(tmp_path, TEST_BASE="1", **args)
    assert "plan: 2 builds, 2 test runs, 1 x 2 sanitizer runs, 3 x 2 x 4 timed runs: ~206 s" in out
