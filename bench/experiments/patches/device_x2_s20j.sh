#!/bin/bash
# x2 (session 20): compute-sanitizer memcheck of a bare NCCL send/recv with
# registered buffers (scripts/probes/nccl_registered_memcheck.cu), then of
# the EP test with long rows (registered) that reported errors inside NCCL's
# kernel in the seventeenth session.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_rt5.gz && chmod +x test_gpu_rt5 nccl_registered_memcheck; cd ..
SECONDS=0
for reg in 1 0; do
  timeout 60 build_g/nccl_registered_memcheck $reg 2>&1 | tail -2 | tee -a $R/log
  timeout 200 compute-sanitizer --tool memcheck build_g/nccl_registered_memcheck $reg > $R/probe_memcheck_$reg.log 2>&1
  echo "probe reg=$reg memcheck rc=$? t=$SECONDS" | tee -a $R/log
  grep -E "ERROR SUMMARY|buffers:|Invalid|out of bounds" $R/probe_memcheck_$reg.log | sort | uniq -c | head -8 | tee -a $R/log
done
timeout 150 compute-sanitizer --tool memcheck build_g/test_gpu_rt5 --gtest_filter='MultiGpuEp.LongRows*' > $R/ep_memcheck.log 2>&1
echo "ep memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED|Invalid" $R/ep_memcheck.log | sort | uniq -c | head -8 | tee -a $R/log
cd $OUT && tar czf j.tgz r && rm -rf r
