#!/bin/bash
# x2 (session 19): routing messages + eager piece (nccl dispatch): EP tests,
# old (reg) vs new (rt) at eager shares 0 / 0.3 / 0.5 / 0.7, a trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz moeflow_rt.gz test_gpu_rt.gz && chmod +x moeflow_reg moeflow_rt test_gpu_rt; cd ..
SECONDS=0
timeout 200 build_g/test_gpu_rt --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
for i in 1 2; do
  for v in reg rt:0.6:1 rt:0.7:1 rt:0.8:1 rt:0.7:2; do
    IFS=: read b e pp <<< "$v"; e=${e:-0.7}; pp=${pp:-2}
    MOEFLOW_EP_EAGER=$e MOEFLOW_EP_EAGER_PARTS=$pp timeout 90 build_g/moeflow_$b bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_${b}_${e}_${pp}_$i.json > $R/bench.log 2>&1
    grep -E "rank 0" $R/bench.log | sed -E 's/^/'$v' /' | tee -a $R/log
  done
done
MOEFLOW_EP_EAGER=0.7 MOEFLOW_EP_EAGER_PARTS=1 MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_rt bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
grep trace $R/trace.log | grep dispatch | sed -n "3,5p;40,44p" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s19b.tgz r && rm -rf r
