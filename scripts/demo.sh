#!/usr/bin/env bash
# Installs FlashKDA (and what it needs) and runs the demo: one KDA prefill layer timed and checked
# against the float64 reference, on the GPU when one of compute capability >= 9.0 is present, on
# the CPU otherwise.  Extra arguments go to examples/demo.py (e.g. --device cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_deps.sh
flashkda_install_deps 0
echo "== flashkda: building and installing the Python package =="
python3 -m pip install --no-build-isolation --disable-pip-version-check -q .
echo "== flashkda: demo =="
python3 examples/demo.py "$@"
