#!/bin/bash
# x2 (session 20): the receive plan and the own rows' permute on the side
# stream (MOEFLOW_EP_SELF_ASIDE, default on) against the caller's stream
# (=0). EP tests, bench dispatch alternating, a trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_sa.gz test_gpu_sa.gz && chmod +x moeflow_sa test_gpu_sa; cd ..
SECONDS=0
timeout 200 build_g/test_gpu_sa --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
run() {  # name, env...
  local n=$1; shift
  env "$@" timeout 90 build_g/moeflow_sa bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-150 | sed -E "s/^/$n /" | tee -a $R/log
}
for i in 1 2 3; do
  run old MOEFLOW_EP_SELF_ASIDE=0
  run new X=0
  run new-c2 MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1 MOEFLOW_EP_EAGER_FIRST=300
  echo "t=$SECONDS" | tee -a $R/log
done
MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_sa bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf sa.tgz r && rm -rf r
