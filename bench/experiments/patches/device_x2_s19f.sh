#!/bin/bash
# x2 (session 19, last): the eager send buffer packed by peer (sized
# eager_share x max_tokens x min(K, W - 1)): EP tests, bench nccl once.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_rt5.gz test_gpu_rt5.gz && chmod +x moeflow_rt5 test_gpu_rt5; cd ..
SECONDS=0
timeout 120 build_g/test_gpu_rt5 --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
timeout 60 build_g/moeflow_rt5 bench dispatch --backend nccl --routings 4 --iters 20 --no-sweep --json $R/bench_nccl.json > $R/bench.log 2>&1
grep -E "rank 0" $R/bench.log | cut -c1-150 | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s19f.tgz r && rm -rf r
