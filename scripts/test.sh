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
