#!/usr/bin/env bash
# Builds moeflow here (no GPU needed) for the GPU machine, against the NCCL
# that machine runs (the nvlink backend compiles NCCL's device API inline, so
# its headers must match the libnccl it loads: docs/ep-nvlink-design.md).
# Then carry build/moeflow, build/tests and build/CTestTestfile.cmake to it.
# Usage: scripts/build_for_device.sh [nccl version, default 2.28.3]
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${1:-2.28.3}"
root="$PWD/.nccl-$ver"
if [ ! -f "$root/include/nccl_device.h" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps -d "$tmp" "nvidia-nccl-cu13==$ver"
  (cd "$tmp" && python3 -m zipfile -e ./*.whl x)
  mkdir -p "$root"
  cp -r "$tmp"/x/nvidia/nccl/include "$tmp"/x/nvidia/nccl/lib "$root"/
  rm -rf "$tmp"
fi
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFLOW_BUILD_EXPERIMENTS=ON \
  -DMOEFLOW_NCCL_ROOT="$root" -UMOEFLOW_NCCL_LIBRARY > /dev/null
ninja -C build
