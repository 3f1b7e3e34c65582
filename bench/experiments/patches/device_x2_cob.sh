#!/bin/bash
# x2 (session 18): the nccl combine unpermutes with the whole GPU when K/W >= 3
# (moeflow_cb) vs main (moeflow_reg): EP tests of the new build, bench alternating.
# (moeflow_cb: a throw-away build, not on main: no difference, dropped.)
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz moeflow_cb.gz test_gpu_cb.gz && chmod +x moeflow_reg moeflow_cb test_gpu_cb; cd ..
SECONDS=0
timeout 100 build_g/test_gpu_cb --gtest_filter='*Ep*:-*Nvlink*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED" $R/tests.log | head | tee -a $R/log
for round in 1 2; do
  for b in reg cb; do
    timeout 60 build_g/moeflow_$b bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_${b}_$round.json > $R/b.log 2>&1
    grep -E "rank 0" $R/b.log | sed -E 's/^/'$b' /; s/GB\/s out \(NCCL a2a same bytes//; s/a2a of the bf16 token rows.*//' | tee -a $R/log
  done
done
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf cb.tgz r && rm -rf r
