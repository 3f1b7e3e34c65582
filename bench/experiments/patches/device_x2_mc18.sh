#!/bin/bash
# x2 (session 18): memcheck of the nccl rounds (plain buffers, API errors of
# NCCL's probing not reported), bench dispatch nccl twice more (JSON).
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz test_gpu_reg.gz && chmod +x moeflow_reg test_gpu_reg; cd ..
SECONDS=0
MOEFLOW_EP_REGISTER=0 timeout 200 compute-sanitizer --tool memcheck --report-api-errors no build_g/test_gpu_reg --gtest_filter='MultiGpuEp.MatchesReference:GpuEp.OneRankMatchesReference' > $R/memcheck.log 2>&1
echo "memcheck rc=$?" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/memcheck.log | tee -a $R/log
for i in 1 2; do
  timeout 90 build_g/moeflow_reg bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_nccl_$i.json > $R/bench_nccl_$i.log 2>&1
  grep -E "rank 0" $R/bench_nccl_$i.log | tee -a $R/log
done
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf mc.tgz r && rm -rf r
