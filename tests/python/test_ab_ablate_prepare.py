"""scripts/ab_ablate_prepare.py: every ablation applies to today's chunk_prepare exactly once, the
overlays are written where scripts/ab_bench.sh looks for them, and a stale edit is refused (CPU only)."""

import importlib.util
import os

import pytest

_ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
_spec = importlib.util.spec_from_file_location("ab_ablate_prepare",
                                               os.path.join(_ROOT, "scripts", "ab_ablate_prepare.py"))
ablate_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablate_mod)


def _kernel():
    with open(os.path.join(_ROOT, ablate_mod.KERNEL)) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(ablate_mod.ABLATIONS))
def test_each_ablation_applies_to_the_kernel(name):
    src = _kernel()
    out = ablate_mod.ablate(src, name)
    assert out != src
    for old, new in ablate_mod.ABLATIONS[name][1]:
        assert old not in out and new in out
    # The edits keep the source's brace structure (a removed call, not a removed scope).
    assert out.count("{") - out.count("}") == src.count("{") - src.count("}")


def test_writes_overlays_for_ab_bench(tmp_path):
    root = tmp_path / "repo"
    kpath = root / ablate_mod.KERNEL
    kpath.parent.mkdir(parents=True)
    kpath.write_text(_kernel())
    assert ablate_mod.main(["p3", "gate", "--root", str(root), "--out", "ab"]) == 0
    for name in ("p3", "gate"):
        written = (root / "ab" / f"x_{name}" / ablate_mod.KERNEL).read_text()
        assert written == ablate_mod.ablate(_kernel(), name)
    assert not (root / "ab" / "x_tinv").exists()


def test_a_stale_edit_is_refused_and_nothing_is_written(tmp_path, capsys):
    root = tmp_path / "repo"
    kpath = root / ablate_mod.KERNEL
    kpath.parent.mkdir(parents=True)
    kpath.write_text(_kernel().replace("qt_kd_passes(std::true_type{});", "qt_kd_passes_renamed();"))
    assert ablate_mod.main(["--root", str(root)]) == 1
    assert "ablation 'p2'" in capsys.readouterr().err
    assert not (root / "ab").exists()
