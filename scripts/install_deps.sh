#!/usr/bin/env bash
# Installs what building and testing FlashKDA needs on a fresh Debian/Ubuntu machine, only where
# missing: a C++ compiler, python3 + pip, GoogleTest, then the pinned Python packages of
# requirements.txt (torch, numpy, pytest, scikit-build-core, cmake, ninja), and for the tests fla
# (requirements-fla.txt) into build/fla-site.  Sourced by
# scripts/test.sh and scripts/demo.sh; safe to run again (it installs nothing twice).
set -euo pipefail

flashkda_install_deps() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local want_gtest="${1:-1}"
  local pkgs=()
  command -v g++ >/dev/null 2>&1 || pkgs+=(g++)
  command -v python3 >/dev/null 2>&1 || pkgs+=(python3)
  python3 -m pip --version >/dev/null 2>&1 || pkgs+=(python3-pip)
  if [ "$want_gtest" = 1 ] && [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
    pkgs+=(libgtest-dev)
  fi
  if [ ${#pkgs[@]} -gt 0 ]; then
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "flashkda: apt-get install ${pkgs[*]}"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${pkgs[@]}"
  fi
  # Debian's system python refuses pip installs without this; a venv/pyenv python ignores it.
  export PIP_BREAK_SYSTEM_PACKAGES=1
  python3 -m pip install -q --disable-pip-version-check -r "$root/requirements.txt"
  # cmake and ninja come from pip above; fall back to Debian's if they are still not on PATH.
  pkgs=()
  command -v cmake >/dev/null 2>&1 || pkgs+=(cmake)
  command -v ninja >/dev/null 2>&1 || pkgs+=(ninja-build)
  if [ ${#pkgs[@]} -gt 0 ]; then
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${pkgs[@]}"
  fi
  # The tests of flashkda.fla_backend run fla's own chunk_kda dispatch (CPU: flashkda's reference
  # behind it) in a subprocess that puts this directory on its path; the main environment stays
  # without fla, so backend selection is tested as on a machine without it.  Pure-Python wheels.
  # Optional: without network (or on a failed install) the fla test skips; nothing else depends on it.
  local fla_stamp
  fla_stamp="$root/build/fla-site/.installed-$(cksum < "$root/requirements-fla.txt" | cut -d' ' -f1)"
  if [ "$want_gtest" = 1 ] && [ ! -f "$fla_stamp" ]; then
    rm -rf "$root/build/fla-site"
    if python3 -m pip install -q --disable-pip-version-check --no-deps --target "$root/build/fla-site" \
        -r "$root/requirements-fla.txt"; then
      touch "$fla_stamp"
    else
      echo "flashkda: warning: could not install requirements-fla.txt into build/fla-site; the fla_backend tests skip"
      rm -rf "$root/build/fla-site"
    fi
  fi
  # nvcc outside PATH (the usual /usr/local/cuda): let CMake find it.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
}
