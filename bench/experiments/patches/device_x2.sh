#!/bin/bash
# x2, one call: EP tests (scales, FP8, registered buffers) + memcheck, nccl
# registered vs plain A/B, fp8 bench, nvlink combine variants A/B, a2a peer.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd build_g && for f in *.gz; do gunzip -f $f; done; chmod +x moeflow_* test_gpu_*; cd ..
nvidia-smi -L
SECONDS=0
echo "== tests reg (*Ep*)"
timeout 240 build_g/test_gpu_reg --gtest_filter='*Ep*' > $OUT/tests.log 2>&1
grep -E "^\[  (PASSED|FAILED|  OK)|FAILED|tests ran|Failure|differ" $OUT/tests.log | head -40
echo "== memcheck t=$SECONDS"
timeout 150 compute-sanitizer --tool memcheck --report-api-errors no build_g/test_gpu_reg --gtest_filter='GpuEp.Fp8*:MultiGpuEp.LongRows*' 2>&1 | grep -E "ERROR SUMMARY|PASSED|FAILED" | head -5
for v in v2 v3; do
  echo "== tests $v (*Nvlink*) t=$SECONDS"
  timeout 100 build_g/test_gpu_$v --gtest_filter='*Nvlink*' 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran" | head -10
done
for b in nccl nvlink; do
  echo "== run --ep $b t=$SECONDS"
  timeout 60 build_g/moeflow_reg run --ep --backend $b --preset qwen3-30b 2>&1 | tail -5
done
echo "== registration check t=$SECONDS"
MOEFLOW_EP_REGISTER=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG timeout 60 build_g/moeflow_reg bench dispatch --preset mixtral --iters 3 --no-sweep 2>&1 | grep -iE "regist" | sed 's/^.*NCCL INFO//' | cut -c1-90 | sort | uniq -c | head -8
for i in 1 2; do
  for reg in 0 1; do
    echo "== nccl register=$reg run $i t=$SECONDS"
    MOEFLOW_EP_REGISTER=$reg timeout 90 build_g/moeflow_reg bench dispatch --iters 20 --no-sweep --json $OUT/nccl_reg${reg}_$i.json > $OUT/nccl_reg${reg}_$i.log 2>&1
    grep -E "rank 0" $OUT/nccl_reg${reg}_$i.log
  done
done
for b in nccl nvlink; do
  echo "== fp8 $b t=$SECONDS"
  timeout 90 build_g/moeflow_reg bench dispatch --backend $b --fp8 --iters 20 --no-sweep --json $OUT/fp8_$b.json > $OUT/fp8_$b.log 2>&1
  grep -E "rank 0|error" $OUT/fp8_$b.log
done
for i in 1 2; do
  for b in reg w12 v2 v3; do
    echo "== nvlink $b run $i t=$SECONDS"
    timeout 80 build_g/moeflow_$b bench dispatch --backend nvlink --iters 20 --no-sweep --json $OUT/nvl_${b}_$i.json > $OUT/nvl_${b}_$i.log 2>&1
    grep -E "rank 0" $OUT/nvl_${b}_$i.log
  done
done
echo "== peers t=$SECONDS"
timeout 120 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $OUT/a2a.json 2>&1 | grep -v -i warn | tail -8
echo "== trace register=1 t=$SECONDS"
MOEFLOW_EP_REGISTER=1 MOEFLOW_EP_TRACE=1 timeout 40 build_g/moeflow_reg bench dispatch --iters 3 --no-sweep 2>&1 | grep trace | tail -4
echo "== done t=$SECONDS"
