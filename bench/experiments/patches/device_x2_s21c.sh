#!/bin/bash
# x2 (session 21): every write compute-sanitizer reports in the registered
# arena (long-row EP test), grouped by allocation, against the exchange
# ranges the EP code gave NCCL (MOEFLOW_EP_DEBUG_RANGES).
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_s21.gz && chmod +x test_gpu_s21; cd ..
SECONDS=0
MOEFLOW_EP_DEBUG_RANGES=1 timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 100000 build_g/test_gpu_s21 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck_long.log 2>&1
echo "ep long-rows memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/ep_memcheck_long.log | tee -a $R/log
grep -B3 "Access to" $R/ep_memcheck_long.log | grep -E "^=========     at |by thread" | sed 's/by thread.*block/block/' | sort | uniq -c | sort -rn | head -20 | tee -a $R/log
python3 bench/experiments/patches/memcheck_ranges.py $R/ep_memcheck_long.log | tee -a $R/log
gzip $R/ep_memcheck_long.log
cd $OUT && tar czf c.tgz r && rm -rf r
