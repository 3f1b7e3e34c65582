#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, memcheck, benchmarks beside
# the PyTorch peers. Logs and JSON go to $OUT (or ./out).
# Usage: scripts/device_check.sh [build|test|memcheck|racecheck|sass|variants|bench|peers|gemm|tune|sweep|gemmpeers|mlp|dispatch|a2apeers|multigpu|nvlink]...
# (default: build test memcheck racecheck sass bench peers)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test memcheck racecheck sass bench peers)
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
rc=0
nvidia-smi -L
if has build; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS="-Xptxas=-v" \
    -DMOEFLOW_BUILD_EXPERIMENTS=ON \
    > "$OUT/configure.log" 2>&1 || { cat "$OUT/configure.log"; exit 1; }
  ninja -C build > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -20
fi
if has test; then
  ctest --test-dir build --timeout 240 --output-on-failure 2>&1 | tail -40 || rc=1
fi
if has memcheck; then
  compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/test_gpu \
    --gtest_filter='Gpu.Permute*:Gpu.Unpermute*:Gpu.Backward*:Gpu.PlanFromMask*:Gpu.PlanCapacity*:Gpu.PlanInvalid*:Gpu.Graph*:*GpuGemm.BadOffsets*:*GpuGemm.Graph*:*GpuGemm.ForwardDgradWgradMatchCpu/Auto:GpuMlp.*' \
    > "$OUT/memcheck.log" 2>&1
  m=$?
  tail -5 "$OUT/memcheck.log"
  echo "memcheck exit: $m"
  [ $m -eq 0 ] || rc=1
fi
if has racecheck; then
  compute-sanitizer --tool racecheck --error-exitcode 9 build/tests/test_gpu \
    --gtest_filter='Gpu.PlanFromMask*:Gpu.PlanCapacity*:Gpu.PlanInvalid*:Gpu.PlanAllTokens*' \
    > "$OUT/racecheck.log" 2>&1
  m=$?
  tail -3 "$OUT/racecheck.log"
  echo "racecheck exit: $m"
  [ $m -eq 0 ] || rc=1
fi
if has sass; then
  # the hot kernels must not touch local memory
  cuobjdump -sass build/CMakeFiles/moeflow.dir/src/cuda/permute.cu.o > "$OUT/permute.sass" 2>&1
  echo "local-memory instructions in permute.cu SASS: $(grep -cE 'STL|LDL' "$OUT/permute.sass")"
fi
if has variants; then
  build/permute_variants 2>&1 || rc=1
fi
if has bench; then
  build/moeflow bench permute --json "$OUT/ours.json" 2>&1 || rc=1
fi
if has gemm; then
  build/moeflow bench gemm --json "$OUT/gemm.json" 2>&1 || rc=1
fi
if has tune; then
  build/moeflow bench gemm --tune --json "$OUT/gemm_tune.json" 2>&1 || rc=1
fi
if has sweep; then
  build/moeflow bench gemm --sweep --json "$OUT/gemm_sweep.json" 2>&1 || rc=1
  PYTHONUNBUFFERED=1 python3 bench/peers_gemm_sweep.py --json "$OUT/peers_gemm_sweep.json" 2>&1 || rc=1
fi
if has peers && [ -f .peers/peers.py ]; then
  PYTHONUNBUFFERED=1 python3 .peers/peers.py --only ceil,permute --json "$OUT/peers.json" 2>&1 | tail -30 || rc=1
fi
if has mlp; then
  timeout 200 build/moeflow bench mlp --json "$OUT/mlp.json" 2>&1 || rc=1
  PYTHONUNBUFFERED=1 python3 bench/peers_mlp.py --json "$OUT/peers_mlp.json" 2>&1 | tail -8 || rc=1
fi
if has dispatch; then  # needs 2+ GPUs (nvidia-h200-x2)
  timeout 200 build/moeflow bench dispatch --json "$OUT/dispatch.json" 2>&1 || rc=1
fi
if has a2apeers && [ -f .peers/a2a_peers.py ]; then
  NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 torchrun --nproc-per-node="$(nvidia-smi -L | wc -l)" \
    .peers/a2a_peers.py --json "$OUT/a2a_peers.json" 2>&1 | tail -30 || rc=1
fi
if has multigpu; then
  ctest --test-dir build -L multigpu --timeout 150 --output-on-failure 2>&1 | tail -20 || rc=1
  timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 build/tests/test_gpu --gtest_filter='MultiGpuEp.*' \
    > "$OUT/memcheck_ep.log" 2>&1
  m=$?; tail -3 "$OUT/memcheck_ep.log"; echo "memcheck (ep) exit: $m"; [ $m -eq 0 ] || rc=1
fi
if has nvlink; then  # backend nvlink: its tests (with memcheck and racecheck) and its bench; 2+ GPUs
  NCCL_NVLS_ENABLE=0 timeout 200 build/tests/test_gpu --gtest_filter='*Nvlink*' 2>&1 | tail -15 || rc=1
  for tool in memcheck racecheck; do
    NCCL_NVLS_ENABLE=0 timeout 300 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
      build/tests/test_gpu --gtest_filter='*Nvlink*' > "$OUT/${tool}_nvlink.log" 2>&1
    m=$?; tail -3 "$OUT/${tool}_nvlink.log"; echo "$tool (nvlink) exit: $m"; [ $m -eq 0 ] || rc=1
  done
  NCCL_NVLS_ENABLE=0 timeout 200 build/moeflow bench dispatch --backend nvlink --json "$OUT/dispatch_nvlink.json" 2>&1 || rc=1
fi
if has gemmpeers && [ -f .peers/peers.py ]; then
  PYTHONUNBUFFERED=1 python3 .peers/peers.py --only gemm --json "$OUT/peers_gemm.json" 2>&1 | tail -40 || rc=1
fi
exit $rc
