"""The prepared kernel changes under experiments/ stay applicable to the tree (CPU only): a patch
that no longer applies is useless to the next device session, so a change to main that breaks one
must regenerate it (experiments/README.md) in the same commit."""

import glob
import os
import shutil
import subprocess

import pytest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_PATCHES = sorted(glob.glob(os.path.join(_ROOT, "experiments", "*.patch")))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch", _PATCHES, ids=[os.path.basename(p) for p in _PATCHES])
def test_patch_applies_to_the_tree(patch):
    r = subprocess.run(["git", "apply", "--check", "--whitespace=nowarn", patch], cwd=_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{os.path.basename(patch)} no longer applies: {r.stderr.strip()}"


def test_every_patch_is_listed_in_the_readme():
    with open(os.path.join(_ROOT, "experiments", "README.md")) as f:
        readme = f.read()
    for p in _PATCHES:
        assert f"`{os.path.basename(p)}`" in readme, os.path.basename(p)
