#!/usr/bin/env bash
# Writes the overlay folder ab/<name>/ for scripts/ab_bench.sh: the version at <ref> of every file
# under csrc/, src/ and include/ that differs between HEAD and <ref> (files absent at <ref> are not
# handled: an overlay only adds or replaces).  <ref> is a git ref, or a patch file (experiments/*.patch,
# applied to a copy of HEAD): prepared changes live as committed patches, because branches do not
# survive from one session's checkout to the next.  Run here, before the device call; ab/ is not
# committed.
#   bash scripts/ab_overlay.sh 718c8ad old_prepare              # ab/old_prepare = 718c8ad's kernels
#   bash scripts/ab_overlay.sh experiments/walk-u.patch walku   # ab/walku = HEAD + the patch's kernels
set -euo pipefail
ref=${1:?usage: ab_overlay.sh <git ref | patch file> <name>}
name=${2:?usage: ab_overlay.sh <git ref | patch file> <name>}
cd "$(git rev-parse --show-toplevel)"
rm -rf "ab/$name"
n=0
if [ -f "$ref" ]; then
  patch=$(realpath "$ref")
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  git archive HEAD | tar -x -C "$tmp"
  (cd "$tmp" && git apply --whitespace=nowarn "$patch")
  for f in $(cd "$tmp" && find csrc src include -type f | sort); do
    if ! cmp -s "$tmp/$f" "$f" 2>/dev/null; then
      mkdir -p "ab/$name/$(dirname "$f")"
      cp "$tmp/$f" "ab/$name/$f"
      n=$((n + 1))
    fi
  done
  echo "ab/$name: $n files from HEAD + $ref"
  exit 0
fi
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
