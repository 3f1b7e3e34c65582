#!/bin/bash
# x2 (session 20): the same memcheck runs as device_x2_s20j.sh without the
# API errors (NCCL's own probing calls), so that what the kernels do shows.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_rt5.gz && chmod +x test_gpu_rt5 nccl_registered_memcheck; cd ..
SECONDS=0
CS="compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30"
for reg in 1 0; do
  timeout 150 $CS build_g/nccl_registered_memcheck $reg > $R/probe_memcheck_$reg.log 2>&1
  echo "probe reg=$reg memcheck rc=$? t=$SECONDS" | tee -a $R/log
  grep -E "ERROR SUMMARY|buffers:" $R/probe_memcheck_$reg.log | tee -a $R/log
done
timeout 150 $CS build_g/test_gpu_rt5 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck.log 2>&1
echo "ep memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/ep_memcheck.log | tee -a $R/log
cd $OUT && tar czf k.tgz r && rm -rf r
