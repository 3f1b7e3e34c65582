#!/bin/bash
# x2 (session 20): memcheck of the long-row EP test with plain buffers
# (MOEFLOW_EP_REGISTER=0): the same transfers, NCCL staging them itself.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_rt5.gz && chmod +x test_gpu_rt5; cd ..
SECONDS=0
MOEFLOW_EP_REGISTER=0 timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30 build_g/test_gpu_rt5 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck_plain.log 2>&1
echo "ep memcheck plain rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED|OK \]" $R/ep_memcheck_plain.log | tee -a $R/log
cd $OUT && tar czf l.tgz r && rm -rf r
