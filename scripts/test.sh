#!/usr/bin/env bash
# Builds and runs the tests. GPU tests (ctest label gpu) run only when a GPU
# is present (MOEFLOW_TEST_GPU=1 forces them, =0 skips them).
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
  echo "no GPU: running the CPU tests (the gpu-labelled tests run on a GPU machine)"
  ctest --test-dir build -LE gpu --output-on-failure
fi
# The Python package, when the build made it (nanobind found): numpy tests on
# the CPU backend everywhere, the torch tests too where torch is installed.
if ls build/python/moeflow/_C*.so >/dev/null 2>&1; then
  PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q python/tests
else
  echo "no Python package in build/ (python3 -m nanobind not found): Python tests not run"
fi
