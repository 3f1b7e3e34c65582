#!/bin/bash
# (moeflow_hk: a throw-away build of src/cuda/ep.cu, not on main: slower, dropped.)
# x2 (session 18): the nccl combine's holder kernel listing a row's kept
# slots first and loading 4 slot rows together (moeflow_hk) vs main
# (moeflow_reg): EP tests of the new build, bench dispatch nccl alternating.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz moeflow_hk.gz test_gpu_hk.gz && chmod +x moeflow_reg moeflow_hk test_gpu_hk; cd ..
SECONDS=0
timeout 100 build_g/test_gpu_hk --gtest_filter='*Ep*:-*Nvlink*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED" $R/tests.log | head | tee -a $R/log
for round in 1 2; do
  for b in reg hk; do
    timeout 60 build_g/moeflow_$b bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_${b}_$round.json > $R/b.log 2>&1
    grep -E "rank 0" $R/b.log | sed -E 's/^/'$b' /; s/GB\/s out \(NCCL a2a same bytes//; s/a2a of the bf16 token rows.*//' | tee -a $R/log
  done
done
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf hk.tgz r && rm -rf r
