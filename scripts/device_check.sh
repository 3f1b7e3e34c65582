#!/usr/bin/env bash
# The standard run on a GPU machine: build, the GPU tests, and the benchmarks
# beside their PyTorch peers, in one command. Logs and JSON go to $OUT
# (default ./out). Steps run in the order given:
#
#   build      configure + build into ./build (Release, sm_90a, experiments on)
#   test       ctest: cpu and gpu labels
#   multigpu   ctest -L multigpu (2+ GPUs), NCCL_NVLS_ENABLE=0
#   memcheck   compute-sanitizer memcheck on the single-GPU tests' main cases
#   racecheck  compute-sanitizer racecheck on the plan kernels and the weights' quantize
#   sanitize-ep  memcheck + racecheck on every multi-GPU and simulated-rank
#              test, one process each (2+ GPUs)
#   permute    moeflow bench permute + the PyTorch permute peers
#   gemm       moeflow bench gemm + torch._grouped_mm (bench/peers_gemm.py)
#   mlp        moeflow bench mlp + the PyTorch composite (bench/peers_mlp.py)
#   dispatch   moeflow bench dispatch, both backends + NCCL all_to_all (2+ GPUs)
#   python     the Python tests on the GPU (pytest python/tests, the machine's torch)
#   pylayer    bench/py_layer.py (MoELayer vs the torch composite, the router;
#              again with align 128) and bench/py_overhead.py (host cost of
#              moeflow.ops calls)
#   mlprows    dev/probes/mlp_rows.py (the grouped MLP on the layer's rows)
#   sonic      bench/peers_sonicmoe.py, SonicMoE installed from ./.sonic (its
#              wheels and the cutlass-dsl libs as libs.tar.xz; the folder is
#              ignored by git) into a folder outside the checkout
#   variants   the permute kernel variants of dev/
#   shortk     the short-K wgrad of the expert-parallel layer (dsv3 FC1 at W = 4:
#              64 experts, K 7168, N 4096; rows per expert 64..4096): moeflow bench
#              gemm --sweep --tune beside torch._grouped_mm (bench/peers_gemm_sweep.py)
#   pyep       the expert-parallel Python tests on the GPUs (python/tests/test_ep.py
#              -k gpu, test_megatron.py) and bench/py_layer_ep.py under torchrun on
#              every GPU (also with a 1.25 receive budget), against megatron-core
#              installed from ./.wheels (its
#              wheel; the folder is ignored by git) into a folder outside the
#              checkout (2+ GPUs)
#   pyepfp8    bench/py_layer_ep.py under torchrun on every GPU: the EP layer in
#              bf16, and in blockwise FP8 with FP8 on the wire (defaults; the
#              weights' codes cached; with FP8 weight gradients) (2+ GPUs)
#
# Default: build test multigpu permute gemm mlp dispatch.
# The PyTorch peers of permute and the all-to-all come from peers.py and
# a2a_peers.py in ./.peers when present (copy them there; the folder is
# ignored by git).
# Usage: scripts/device_check.sh [step...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test multigpu permute gemm mlp dispatch)
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L
rc=0
step() { echo "== $1 ($(date +%T))"; }
fail() { echo "!! $1 failed"; rc=1; }

for s in "${steps[@]}"; do
  step "$s"
  case "$s" in
    build)
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS="-Xptxas=-v" \
        -DMOEFLOW_BUILD_EXPERIMENTS=ON > "$OUT/configure.log" 2>&1 || { cat "$OUT/configure.log"; exit 1; }
      ninja -C build > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
      grep -cE "spill stores" "$OUT/build.log" | sed 's/^/ptxas lines with spill counts: /'
      ;;
    test)
      ctest --test-dir build -L "cpu|gpu" -LE multigpu --timeout 300 --output-on-failure | tail -20 || fail test
      ;;
    multigpu)
      if [ "$ngpu" -ge 2 ]; then
        ctest --test-dir build -L multigpu --timeout 300 --output-on-failure | tail -20 || fail multigpu
      else
        echo "SKIPPED: multigpu needs 2+ GPUs ($ngpu here)"
      fi
      ;;
    memcheck)
      compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/test_gpu \
        --gtest_filter='Gpu.*:*GpuGemm.BadOffsets*:*GpuGemm.Graph*:*GpuGemm.ForwardDgradWgradMatchCpu/Auto:*GpuGemm.WgradHalfPrecision*/Auto:GpuMlp.*:GpuRouter.*:GpuRouterPaths.*:GpuPermuteQuantize.*:GpuQuantize.*:GpuQuantizeWeights.*:GpuGemmFp8.*' \
        > "$OUT/memcheck.log" 2>&1 || fail memcheck
      tail -3 "$OUT/memcheck.log"
      ;;
    racecheck)
      compute-sanitizer --tool racecheck --error-exitcode 9 build/tests/test_gpu \
        --gtest_filter='Gpu.Plan*:GpuQuantizeWeights.*' > "$OUT/racecheck.log" 2>&1 || fail racecheck
      tail -3 "$OUT/racecheck.log"
      ;;
    sanitize-ep)
      # One process per test (a kernel fault ends its CUDA context). NCCL's
      # zero-copy writes into a peer's registered buffer are reported out of
      # bounds by memcheck although they land inside the posted receive range
      # (docs/ep.md, "Sanitizers"), so NCCL's registration is declined here;
      # simulated ranks run 8 blocks each so that every rank stays resident
      # under the instrumentation.
      if [ "$ngpu" -ge 2 ]; then
        tests=$(build/tests/test_gpu --gtest_list_tests --gtest_filter='MultiGpu*:GpuEpNvlinkSimulated.*' |
          awk '/^[^ ]/{s=$1} /^  /{print s $1}')
        for tool in memcheck racecheck; do
          : > "$OUT/${tool}_ep.log"
          for t in $tests; do
            NCCL_LOCAL_REGISTER=0 MOEFLOW_TEST_SIM_BLOCKS=8 timeout 300 compute-sanitizer --tool $tool \
              --report-api-errors no --error-exitcode 9 build/tests/test_gpu --gtest_filter="$t" \
              > "$OUT/sanitize.tmp" 2>&1 || fail "$tool $t"
            echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize.tmp" | tail -1)" |
              tee -a "$OUT/${tool}_ep.log"
          done
        done
        rm -f "$OUT/sanitize.tmp"
      else
        echo "SKIPPED: sanitize-ep needs 2+ GPUs ($ngpu here)"
      fi
      ;;
    permute)
      build/moeflow bench permute --json "$OUT/permute.json" || fail permute
      [ -f .peers/peers.py ] && { PYTHONUNBUFFERED=1 python3 .peers/peers.py --only ceil,permute \
        --json "$OUT/peers_permute.json" | tail -20 || fail "permute peers"; }
      ;;
    gemm)
      build/moeflow bench gemm --json "$OUT/gemm.json" || fail gemm
      PYTHONPATH=bench PYTHONUNBUFFERED=1 python3 bench/peers_gemm.py \
        --json "$OUT/peers_gemm.json" || fail "gemm peers"
      ;;
    mlp)
      timeout 300 build/moeflow bench mlp --json "$OUT/mlp.json" || fail mlp
      PYTHONUNBUFFERED=1 python3 bench/peers_mlp.py --json "$OUT/peers_mlp.json" | tail -8 || fail "mlp peers"
      ;;
    dispatch)
      if [ "$ngpu" -ge 2 ]; then
        timeout 300 build/moeflow bench dispatch --json "$OUT/dispatch.json" || fail dispatch
        timeout 300 build/moeflow bench dispatch --backend nvlink --json "$OUT/dispatch_nvlink.json" ||
          fail "dispatch nvlink"
        [ -f .peers/a2a_peers.py ] && { PYTHONUNBUFFERED=1 timeout 200 torchrun --nproc-per-node="$ngpu" \
          .peers/a2a_peers.py --json "$OUT/a2a_peers.json" | tail -20 || fail "a2a peers"; }
      else
        echo "SKIPPED: dispatch needs 2+ GPUs ($ngpu here)"
      fi
      ;;
    variants)
      build/permute_variants || fail variants
      ;;
    shortk)
      sweep=(--sweep-experts 64 --sweep-k 7168 --sweep-n 4096)
      timeout 500 build/moeflow bench gemm --sweep "${sweep[@]}" --tune \
        --json "$OUT/gemm_shortk.json" > "$OUT/gemm_shortk.log" 2>&1 || fail shortk
      grep -E "^\[|wgrad|tune" "$OUT/gemm_shortk.log" | head -120
      PYTHONPATH=bench PYTHONUNBUFFERED=1 timeout 200 python3 bench/peers_gemm_sweep.py \
        --experts 64 --k 7168 --n 4096 --json "$OUT/peers_shortk.json" || fail "shortk peers"
      ;;
    pyep)
      if [ "$ngpu" -ge 2 ]; then
        mcore=/tmp/moeflow-mcore
        ls .wheels/megatron_core-*.whl > /dev/null 2>&1 &&
          python3 -m pip install -q --no-deps --no-index --target "$mcore" .wheels/megatron_core-*.whl
        # the worlds of every GPU here (all worlds 2..4 take over 10 minutes on 4 GPUs)
        MCORE_PATH="$mcore" PYTHONPATH=build/python timeout 500 python3 -m pytest -q -rs python/tests/test_ep.py \
          python/tests/test_megatron.py -k "(gpu and ${ngpu}-) or test_gpu_one_rank or megatron" \
          > "$OUT/pytest_ep.log" 2>&1 || fail "python ep"
        tail -5 "$OUT/pytest_ep.log"
        # the peer once; ours also with a receive budget of 1.25 T K rows (memory)
        for run in "nvlink both" "nvlink ours 1.25" "nccl ours"; do
          set -- $run
          cap=(); tag=$1
          [ -n "${3:-}" ] && { cap=(--capacity-factor "$3"); tag=${1}_cap$3; }
          PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 500 torchrun \
            --nproc-per-node="$ngpu" bench/py_layer_ep.py --backend "$1" --impl "$2" "${cap[@]}" \
            --mcore-path "$mcore" --json "$OUT/py_layer_ep_${tag}_w${ngpu}.json" ||
            fail "py_layer_ep $tag"
        done
      else
        echo "SKIPPED: pyep needs 2+ GPUs ($ngpu here)"
      fi
      ;;
    pyepfp8)
      if [ "$ngpu" -ge 2 ]; then
        # the EP layer in FP8 (FP8 on the wire) beside the bf16 one: the defaults,
        # the weights' codes cached (micro-batches), and FP8 weight gradients too
        for run in "bf16" "fp8" "fp8 --fp8-weight-cache" \
                   "fp8 --fp8-weight-cache --fp8-wgrad --align 128"; do
          set -- $run
          tag=$(echo "$run" | tr -d ' -' | cut -c1-24)
          extra=("${@:2}")
          [ "$1" = fp8 ] && extra=(--precision fp8-blockwise --fp8-wire "${extra[@]}")
          PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 300 torchrun \
            --nproc-per-node="$ngpu" bench/py_layer_ep.py --impl ours "${extra[@]}" \
            --json "$OUT/py_layer_ep_${tag}_w${ngpu}.json" 2>&1 | grep -v "^W1" | tail -8 ||
            fail "py_layer_ep $tag"
        done
      else
        echo "SKIPPED: pyepfp8 needs 2+ GPUs ($ngpu here)"
      fi
      ;;
    python)
      PYTHONPATH=build/python timeout 500 python3 -m pytest -q -rs python/tests \
        > "$OUT/pytest.log" 2>&1 || fail python
      tail -15 "$OUT/pytest.log"
      ;;
    pylayer)
      PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 400 python3 bench/py_layer.py \
        --profile --router --json "$OUT/py_layer.json" || fail pylayer
      PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 200 python3 bench/py_layer.py \
        --align 128 --json "$OUT/py_layer_align128.json" || fail "pylayer align 128"
      PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 100 python3 bench/py_overhead.py \
        --json "$OUT/py_overhead.json" || fail "py overhead"
      ;;
    mlprows)
      PYTHONPATH=build/python:bench PYTHONUNBUFFERED=1 timeout 200 python3 dev/probes/mlp_rows.py ||
        fail mlprows
      ;;
    sonic)
      if [ -d .sonic ]; then
        site=/tmp/moeflow-sonic
        mkdir -p "$site"
        [ -f .sonic/libs.tar.xz ] && tar xJf .sonic/libs.tar.xz -C "$site"
        python3 -m pip install -q --no-deps --no-index --target "$site" .sonic/*.whl ||
          fail "sonic install"
        # (the libs' .pth line, which --target does not process)
        PYTHONPATH="$site:$site/nvidia_cutlass_dsl/python_packages:build/python:bench" \
          PYTHONUNBUFFERED=1 timeout 400 \
          python3 bench/peers_sonicmoe.py --stack-after 380 --json "$OUT/sonicmoe.json" ||
          fail sonic
      else
        echo "SKIPPED: sonic needs ./.sonic (the SonicMoE wheels)"
      fi
      ;;
    *)
      echo "unknown step: $s"; exit 2
      ;;
  esac
done
exit $rc
