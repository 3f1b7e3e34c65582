#!/bin/bash
# x2 (session 19): the pack kernel with 8 loads in flight per lane (rt4)
# against the committed code (rt3): EP tests, bench nccl alternating, a trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_rt3.gz moeflow_rt4.gz test_gpu_rt4.gz && chmod +x moeflow_rt3 moeflow_rt4 test_gpu_rt4; cd ..
SECONDS=0
timeout 200 build_g/test_gpu_rt4 --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
for i in 1 2; do
  for v in rt3 rt4; do
    timeout 90 build_g/moeflow_$v bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_${v}_$i.json > $R/bench.log 2>&1
    grep -E "rank 0" $R/bench.log | sed -E 's/^/'$v' /' | cut -c1-150 | tee -a $R/log
  done
done
MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_rt4 bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
grep trace $R/trace.log | grep dispatch | sed -n "3,5p;40,44p" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s19e.tgz r && rm -rf r
