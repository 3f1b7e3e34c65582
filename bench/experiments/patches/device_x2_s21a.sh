#!/bin/bash
# x2 (session 21): does an NCCL self transfer inside the registered arena
# bring compute-sanitizer's reports (probe mode 3)? Then the EP tests with
# combine backward's own range copied on the stream instead (test_gpu_s21):
# the EP suite, memcheck of the long-row test and of every MultiGpuEp test.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_s21.gz && chmod +x test_gpu_s21 nccl_registered_memcheck; cd ..
SECONDS=0
timeout 60 build_g/nccl_registered_memcheck 3 2>&1 | tail -2 | tee -a $R/log
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 build_g/nccl_registered_memcheck 3 > $R/probe_memcheck_3.log 2>&1
echo "probe mode 3 memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|buffers:" $R/probe_memcheck_3.log | tee -a $R/log
grep -E "Invalid|out of bounds|nearest" $R/probe_memcheck_3.log | sort | uniq -c | head -6 | tee -a $R/log
timeout 120 build_g/test_gpu_s21 --gtest_filter='*Ep*' > $R/ep_tests.log 2>&1
echo "ep tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "PASSED|FAILED|tests ran" $R/ep_tests.log | tee -a $R/log
timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 build_g/test_gpu_s21 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck_long.log 2>&1
echo "ep long-rows memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/ep_memcheck_long.log | tee -a $R/log
grep -E "Invalid|nearest" $R/ep_memcheck_long.log | sort | uniq -c | head -6 | tee -a $R/log
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 build_g/test_gpu_s21 --gtest_filter='MultiGpuEp.*' > $R/ep_memcheck_all.log 2>&1
echo "ep all multigpu memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED|tests ran|^\[       OK" $R/ep_memcheck_all.log | tee -a $R/log
grep -E "Invalid|nearest" $R/ep_memcheck_all.log | sort | uniq -c | head -6 | tee -a $R/log
cd $OUT && tar czf a.tgz r && rm -rf r
