#!/usr/bin/env bash
# Builds (scripts/build.sh) and runs every test:
#  1. the C++ tests (ctest). GPU tests (label gpu) run only when a GPU is
#     present: MOEFLOW_TEST_GPU=1 forces them, =0 skips them (and hides the
#     GPU from the Python tests too).
#  2. the Python package's tests and the examples (python/tests, pytest, with
#     the python of scripts/setup.sh's environment): numpy on the CPU
#     backend everywhere, torch ones where torch is installed (otherwise
#     listed as SKIPPED with the reason). If the package or a module the tests
#     need is missing, this fails and says what is missing; they are never
#     skipped silently. MOEFLOW_TEST_PYTHON=0 leaves them out, saying so.
# Extra arguments go to cmake (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh "$@"
gpu="${MOEFLOW_TEST_GPU:-auto}"
if [ "$gpu" = auto ]; then
  gpu=0
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1
fi
if [ "$gpu" = 1 ]; then
  ctest --test-dir build --output-on-failure
else
  echo "test: no GPU: running the CPU tests (the gpu-labelled tests run on a GPU machine)"
  ctest --test-dir build -LE gpu --output-on-failure
fi

if [ "${MOEFLOW_TEST_PYTHON:-1}" = 0 ]; then
  echo "test: MOEFLOW_TEST_PYTHON=0: the Python tests and examples were NOT run"
  exit 0
fi
venv="${MOEFLOW_VENV:-$PWD/.venv}"
py="$venv/bin/python"
fail() {
  echo "test: FAILED: $*" >&2
  echo "test: (scripts/setup.sh installs what the Python tests need; MOEFLOW_TEST_PYTHON=0 leaves them out)" >&2
  exit 1
}
[ -x "$py" ] || fail "no Python environment at $venv"
for m in numpy pytest; do
  "$py" -c "import $m" >/dev/null 2>&1 || fail "$py cannot import $m"
done
if grep -q '^MOEFLOW_BUILD_PYTHON:STRING=OFF' build/CMakeCache.txt 2>/dev/null ||
   ! ls build/python/moeflow/_C*.so >/dev/null 2>&1; then
  "$py" -c "import nanobind" >/dev/null 2>&1 || fail "$py cannot import nanobind: the Python package was not built"
  fail "the Python package was not built (no build/python/moeflow/_C*.so; was -DMOEFLOW_BUILD_PYTHON=OFF given?)"
fi
# The torch autograd nodes in C++ are built wherever the torch imported has
# the C++11 ABI and its headers (cmake/torch_nodes.cmake): their absence
# there is a broken build, not a reason to test the Python nodes alone.
if "$py" -c "import os, sys, torch; sys.exit(not (torch._C._GLIBCXX_USE_CXX11_ABI and os.path.exists(os.path.join(os.path.dirname(torch.__file__), 'include/torch/csrc/autograd/custom_function.h'))))" >/dev/null 2>&1 &&
   ! grep -q '^MOEFLOW_BUILD_TORCH_NODES:STRING=OFF' build/CMakeCache.txt 2>/dev/null &&
   ! ls build/python/moeflow/_autograd*.so >/dev/null 2>&1; then
  fail "moeflow._autograd was not built although $py's torch could build it (see the CMake output: 'moeflow: no torch autograd nodes in C++ (...)')"
fi
env=(PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}")
# megatron-core's sources for the moeflow.megatron tests (scripts/setup.sh)
[ -d "$venv/mcore/megatron/core" ] && env+=(MCORE_PATH="$venv/mcore")
[ "$gpu" = 1 ] || env+=(CUDA_VISIBLE_DEVICES=)
env "${env[@]}" "$py" -c "import moeflow; print('test: Python package', moeflow.build_info())"
env "${env[@]}" "$py" -m pytest -q -rs python/tests
# The Python autograd nodes (what an install without moeflow._autograd runs):
# the ops' and the layer's tests once more with them.
if ls build/python/moeflow/_autograd*.so >/dev/null 2>&1; then
  env "${env[@]}" MOEFLOW_TORCH_NODES=0 "$py" -m pytest -q -rs python/tests/test_torch.py \
    python/tests/test_router.py python/tests/test_layer.py python/tests/test_layer_routing.py \
    python/tests/test_torch_nodes.py
fi
