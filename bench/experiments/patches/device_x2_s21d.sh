#!/bin/bash
# x2 (session 21): the copy ceilings of an H100 pair (docs/perf/nvlink-copy-probe.cu,
# both GPUs at once: push into the peer, pull, local copy / read), and the EP
# GPU tests of the final build.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf test_gpu_s21.gz && chmod +x test_gpu_s21 nvlink_copy_probe; cd ..
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee -a $R/log
timeout 200 build_g/nvlink_copy_probe > $R/probe.log 2>&1
echo "probe rc=$? t=$SECONDS" | tee -a $R/log
sort -k2,2 -k3 $R/probe.log | grep "rank 0" | tee -a $R/log
timeout 150 build_g/test_gpu_s21 --gtest_filter='*Ep*' > $R/ep_tests.log 2>&1
echo "ep tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "PASSED|FAILED|tests ran" $R/ep_tests.log | tee -a $R/log
cd $OUT && tar czf d.tgz r && rm -rf r
