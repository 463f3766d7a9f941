#!/usr/bin/env bash
# THE test command of FlashKDA (CI runs it through .ci/run):
#   1. installs what is missing (scripts/install_deps.sh),
#   2. builds the library and the GoogleTest suite with CMake (CUDA kernels too when nvcc is found,
#      so they at least compile here) and runs ctest, then the C++ suite again under ASan + UBSan,
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

# The same C++ suite (reference, validation, layouts, walk order) once more under AddressSanitizer,
# LeakSanitizer and UndefinedBehaviorSanitizer, CPU build: the host code must not read or write out
# of bounds on any input the tests give it (a UB finding aborts: -fno-sanitize-recover).
# FLASHKDA_SANITIZE=0 skips it (about a minute on two cores).
if [ "${FLASHKDA_SANITIZE:-1}" != "0" ]; then
  echo "== flashkda: C++ tests under ASan + UBSan (CPU build) =="
  SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O1"
  cmake -S "$ROOT" -B "$ROOT/build/sanitize" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLASHKDA_BUILD_TESTS=ON \
    -DFLASHKDA_ENABLE_CUDA=OFF -DCMAKE_CXX_FLAGS="$SAN_FLAGS" -DCMAKE_EXE_LINKER_FLAGS="$SAN_FLAGS"
  cmake --build "$ROOT/build/sanitize" -j "$JOBS" --target flashkda_tests
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$ROOT/build/sanitize/flashkda_tests" --gtest_brief=1
fi

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
