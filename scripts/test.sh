#!/usr/bin/env bash
# THE test command of FlashKDA (CI runs it through .ci/run):
#   1. installs what is missing (scripts/install_deps.sh),
#   2. builds the library and the GoogleTest suite with CMake (CUDA kernels too when nvcc is found,
#      so they at least compile here) and runs ctest,
#   3. installs the C++ library to build/prefix (cmake --install), builds examples/cpp against it
#      with find_package(flashkda) and runs it (on the GPU when a usable one is present, else CPU),
#   4. builds and installs the Python package (the torch op library) and runs pytest.
# GPU tests (tests/python/test_gpu.py) are skipped unless a GPU of compute capability >= 9.0 is present.
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
source scripts/install_deps.sh
flashkda_install_deps 1

JOBS="${FLASHKDA_JOBS:-$(nproc)}"
BUILD="$ROOT/build/cpp"
CUDA=OFF
if command -v nvcc >/dev/null 2>&1 || [ -n "${CUDACXX:-}" ]; then CUDA=ON; fi
echo "== flashkda: C++ build (CUDA kernels: $CUDA) =="
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHKDA_BUILD_TESTS=ON \
  -DFLASHKDA_ENABLE_CUDA="$CUDA"
cmake --build "$BUILD" -j "$JOBS"
echo "== flashkda: ctest =="
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"

echo "== flashkda: C++ consumer (cmake --install, find_package, examples/cpp) =="
PREFIX="$ROOT/build/prefix"
EXAMPLE_BUILD="$ROOT/build/example-cpp"
rm -rf "$PREFIX" "$EXAMPLE_BUILD"
cmake --install "$BUILD" --prefix "$PREFIX"
cmake -S "$ROOT/examples/cpp" -B "$EXAMPLE_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX"
cmake --build "$EXAMPLE_BUILD" -j "$JOBS"
"$EXAMPLE_BUILD/flashkda_example"

echo "== flashkda: Python package =="
# The wheel build reuses the CMake tree above (same options plus the torch op library), so the
# CUDA kernels are compiled once.
CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" python3 -m pip install --no-build-isolation --disable-pip-version-check -v . \
  -C build-dir="$BUILD" -C cmake.define.FLASHKDA_BUILD_TESTS=ON -C cmake.define.FLASHKDA_ENABLE_CUDA="$CUDA"

echo "== flashkda: pytest =="
cd "$ROOT"
python3 -m pytest -q tests/python
