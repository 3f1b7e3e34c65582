#!/usr/bin/env bash
# Configures and builds moeflow into ./build: the library, the `moeflow`
# command line, the tests and the Python package (build/python/moeflow, with
# the python of the environment scripts/setup.sh made: .venv, or
# MOEFLOW_VENV). CMakeLists.txt finds CUDA (nvcc on PATH, else
# /usr/local/cuda/bin/nvcc); MOEFLOW_WITH_CUDA=OFF forces the CPU backend.
# Extra arguments go to cmake, e.g. -DMOEFLOW_CUDA_ARCHS="80;90a".
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${MOEFLOW_VENV:-$PWD/.venv}"
args=()
if [ -x "$venv/bin/python" ]; then
  args+=("-DPython_EXECUTABLE=$venv/bin/python")
else
  echo "build: no Python environment at $venv (scripts/setup.sh makes it):" \
       "the Python package is built only if python3 on PATH has nanobind"
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${args[@]}" "$@"
cmake --build build -j"$(nproc)"
