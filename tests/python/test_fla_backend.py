"""flashkda.fla_backend: flashkda registered as a backend of fla's own chunk_kda dispatch (fla >= 0.6).

The dispatch checks run in a subprocess (fla_dispatch_check.py) whose path holds fla from
build/fla-site (scripts/install_deps.sh installs it there, pinned in requirements-fla.txt), so this
process, and every other test, sees a machine without fla.
"""

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

import flashkda.fla_backend as FB

HERE = os.path.dirname(os.path.abspath(__file__))
FLA_SITE = os.environ.get("FLASHKDA_FLA_SITE", os.path.join(HERE, "..", "..", "build", "fla-site"))


def _fla_importable() -> bool:
    try:
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(_fla_importable(), reason="fla is installed in this environment")
def test_register_without_fla_says_so():
    with pytest.raises(RuntimeError, match=r"fla \(flash-linear-attention >= 0\.6, `pip install fla-core`\) "
                                           r"could not be imported"):
        FB.register()


def test_register_refuses_bad_arguments_before_importing_fla():
    with pytest.raises(ValueError, match=r"argument 'backend' must be one of \('cuda', 'reference'\), got 'triton'"):
        FB.register(backend="triton")
    with pytest.raises(ValueError, match=r"argument 'priority' must be an int, got 1\.5"):
        FB.register(priority=1.5)


def test_fla_dispatch_runs_flashkda():
    if not os.path.isfile(os.path.join(FLA_SITE, "fla", "backends.py")):
        pytest.skip(f"no fla >= 0.6 at {FLA_SITE} (scripts/test.sh installs it there)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([FLA_SITE, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("FLA_FLASHKDA", None)
    env.pop("FLASHKDA_BACKEND", None)
    r = subprocess.run([sys.executable, os.path.join(HERE, "fla_dispatch_check.py")], env=env, cwd=HERE,
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    for check in ("registration", "same results", "declines", "decode", "fall back", "switches"):
        assert f"ok {check}" in r.stdout, r.stdout


def _inspect_arguments(fn, args, kwargs):
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.mark.parametrize("fn", ["chunk", "decode"])
def test_binder_reads_calls_as_inspect_does(fn):
    """The verifiers' fast argument binder gives what inspect.Signature.bind gives (defaults applied,
    unknown keywords under 'kwargs'), and refuses what it refuses."""
    import flashkda.chunk as FC
    target = FC.chunk_kda if fn == "chunk" else FB._fla_decode_signature
    binder = FB._Binder(target)
    q, k, v, g, beta = "q", "k", "v", "g", "beta"
    calls = [((q, k, v, g, beta), {}),
             ((q, k, v, g, beta, 0.5), {"initial_state": "h0", "other": 3}),
             ((q, k), {"v": v, "g": g, "beta": beta, "cu_seqlens": "cu"}),
             ((q, k, v, g, beta) + tuple(range(3)), {"lower_bound": -1.0, "zz": None})]
    for args, kwargs in calls:
        assert binder(args, kwargs) == _inspect_arguments(target, args, kwargs), (args, kwargs)
    for args, kwargs in [((q, k, v, g), {}),                      # beta missing
                         ((q, k, v, g, beta), {"q": q}),          # q twice
                         (tuple(range(40)), {})]:                 # too many positional
        with pytest.raises(TypeError):
            inspect.signature(target).bind(*args, **kwargs)
        with pytest.raises(TypeError):
            binder(args, kwargs)


def test_fla_dispatch_off_is_said():
    """FLA_DISABLE_BACKEND_DISPATCH=1 (fla reads it at import; the benchmarks set it for their baseline):
    register() says dispatch is off instead of registering nothing, registered() is False, unregister()
    is a no-op."""
    if not os.path.isfile(os.path.join(FLA_SITE, "fla", "backends.py")):
        pytest.skip(f"no fla >= 0.6 at {FLA_SITE} (scripts/test.sh installs it there)")
    code = (
        "import sys\n"
        "import flashkda.fla_backend as FB\n"
        "try:\n"
        "    import fla.ops.kda\n"
        "except Exception as e:\n"
        "    print('skip:', e); sys.exit(77)\n"
        "try:\n"
        "    FB.register(backend='reference')\n"
        "except RuntimeError as e:\n"
        "    assert \"fla's backend dispatch is off\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('register() did not raise')\n"
        "assert FB.registered() is False\n"
        "FB.unregister()\n"
        "print('ok dispatch off')\n")
    env = dict(os.environ, FLA_DISABLE_BACKEND_DISPATCH="1")
    env["PYTHONPATH"] = os.pathsep.join([FLA_SITE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and "ok dispatch off" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
