#!/usr/bin/env bash
# Installs what the build needs and is missing (Debian/Ubuntu packages).
# The CUDA toolkit (nvcc) is used when present; without it the CPU backend is built.
set -euo pipefail
pkgs=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libfmt-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
# The Python package (nanobind) and its tests (numpy, pytest), when python3 has pip.
if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c "import nanobind, numpy, pytest" >/dev/null 2>&1; then
    echo "installing (pip): nanobind numpy pytest"
    python3 -m pip install --quiet nanobind numpy pytest ||
      echo "note: pip could not install nanobind/numpy/pytest; the Python package is not built"
  fi
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: no CUDA toolkit found; building the CPU backend only"
fi
