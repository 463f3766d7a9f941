#!/usr/bin/env bash
# Writes the overlay folder ab/<name>/ for scripts/ab_bench.sh: the version at <ref> of every file
# under csrc/, src/ and include/ that differs between HEAD and <ref> (files absent at <ref> are not
# handled: an overlay only adds or replaces).  Run here, before the device call; ab/ is not committed.
#   bash scripts/ab_overlay.sh 718c8ad old_prepare     # the tree = new, ab/old_prepare = 718c8ad's kernels
set -euo pipefail
ref=${1:?usage: ab_overlay.sh <git ref> <name>}
name=${2:?usage: ab_overlay.sh <git ref> <name>}
cd "$(git rev-parse --show-toplevel)"
rm -rf "ab/$name"
n=0
for f in $(git diff --name-only HEAD "$ref" -- csrc src include); do
  if git cat-file -e "$ref:$f" 2>/dev/null; then
    mkdir -p "ab/$name/$(dirname "$f")"
    git show "$ref:$f" > "ab/$name/$f"
    n=$((n + 1))
  else
    echo "skipped $f (not in $ref)"
  fi
done
echo "ab/$name: $n files from $ref"
