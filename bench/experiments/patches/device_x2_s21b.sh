#!/bin/bash
# x2 (session 21): where the writes compute-sanitizer reports in the
# registered arena lie against the ranges the EP code gave NCCL
# (MOEFLOW_EP_DEBUG_RANGES prints the arena layout and every exchange's
# ranges); then memcheck of every MultiGpuEp test with plain buffers.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_s21.gz && chmod +x test_gpu_s21; cd ..
SECONDS=0
MOEFLOW_EP_DEBUG_RANGES=1 timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 6 build_g/test_gpu_s21 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck_long.log 2>&1
echo "ep long-rows memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/ep_memcheck_long.log | tee -a $R/log
grep -E "Access to|nearest|^\[ep rank" $R/ep_memcheck_long.log | head -60 | tee -a $R/log
MOEFLOW_EP_REGISTER=0 timeout 250 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 build_g/test_gpu_s21 --gtest_filter='MultiGpuEp.*' > $R/ep_memcheck_plain.log 2>&1
echo "ep all multigpu memcheck, plain buffers rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED|^\[       OK" $R/ep_memcheck_plain.log | tee -a $R/log
cd $OUT && tar czf b.tgz r && rm -rf r
