#!/bin/bash
# x2, one call (session 17): early meta (routing metadata sent before the
# host sync) for the nccl backend: EP tests, memcheck, A/B against the old
# order in one run, trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -f $f; done; chmod +x moeflow_reg test_gpu_reg; cd ..
nvidia-smi -L
SECONDS=0
echo "== tests (*Ep*)"
timeout 120 build_g/test_gpu_reg --gtest_filter='*Ep*' > $R/tests_ep.log 2>&1
grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran|Failure" $R/tests_ep.log | head -20
echo "== tests early meta off t=$SECONDS"
MOEFLOW_EP_EARLY_META=0 timeout 60 build_g/test_gpu_reg --gtest_filter='MultiGpuEp.*:GpuEp.*' 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED" | head
for i in 1 2; do
  for em in 1 0; do
    echo "== early_meta=$em run $i t=$SECONDS"
    MOEFLOW_EP_EARLY_META=$em timeout 60 build_g/moeflow_reg bench dispatch --iters 20 --no-sweep --json $R/em${em}_$i.json > $R/em${em}_$i.log 2>&1
    grep -E "rank 0" $R/em${em}_$i.log
  done
done
echo "== fp8 t=$SECONDS"
timeout 60 build_g/moeflow_reg bench dispatch --fp8 --iters 20 --no-sweep --json $R/fp8.json > $R/fp8.log 2>&1; grep -E "rank 0|rror" $R/fp8.log
echo "== trace t=$SECONDS"
MOEFLOW_EP_TRACE=1 timeout 40 build_g/moeflow_reg bench dispatch --iters 3 --no-sweep > $R/trace.log 2>&1; grep "dispatch trace" $R/trace.log | tail -8
echo "== memcheck t=$SECONDS"
MOEFLOW_EP_REGISTER=0 timeout 150 compute-sanitizer --tool memcheck --report-api-errors no build_g/test_gpu_reg --gtest_filter='MultiGpuEp.MatchesReference:MultiGpuEp.Overflow*' > $R/memcheck.log 2>&1; grep -E "ERROR SUMMARY|PASSED|FAILED" $R/memcheck.log | head
echo "== run --ep t=$SECONDS"
timeout 60 build_g/moeflow_reg run --ep --backend nccl --preset qwen3-30b 2>&1 | tail -3
cd $OUT && tar czf x2c.tgz r && rm -rf r
echo "== done t=$SECONDS"
