#!/usr/bin/env bash
# Configures and builds moeflow into ./build (CUDA backend when nvcc is found).
# Extra arguments go to cmake, e.g. -DMOEFLOW_CUDA_ARCHS="80;90a".
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j"$(nproc)"
