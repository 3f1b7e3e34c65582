#!/bin/bash
# x2 (session 19): the counts on the side stream (eager piece no longer
# queued behind them), eager shares 0.5 / 0.6 / 0.7, against the committed
# eager code (rt) in the same call.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_rt.gz moeflow_rt2.gz test_gpu_rt2.gz && chmod +x moeflow_rt moeflow_rt2 test_gpu_rt2; cd ..
SECONDS=0
timeout 200 build_g/test_gpu_rt2 --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
for i in 1 2; do
  for v in rt:0.7 rt2:0.5 rt2:0.6 rt2:0.7; do
    IFS=: read b e <<< "$v"
    MOEFLOW_EP_EAGER=$e timeout 90 build_g/moeflow_$b bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_${b}_${e}_$i.json > $R/bench.log 2>&1
    grep -E "rank 0" $R/bench.log | sed -E 's/^/'$v' /' | cut -c1-120 | tee -a $R/log
  done
done
MOEFLOW_EP_EAGER=0.5 MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_rt2 bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
grep trace $R/trace.log | grep dispatch | sed -n "3,5p;40,44p" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s19c.tgz r && rm -rf r
