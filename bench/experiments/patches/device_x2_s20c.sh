#!/bin/bash
# x2 (session 20): the eager piece in parts on two communicators
# (MOEFLOW_EP_EAGER_COMM2=1: odd parts on a split of the group's
# communicator and a second stream). EP tests with it on, then bench
# dispatch (nccl, both presets) over variants, alternating with the default.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_c2.gz test_gpu_c2.gz && chmod +x moeflow_c2 test_gpu_c2; cd ..
SECONDS=0
MOEFLOW_EP_EAGER_COMM2=1 MOEFLOW_EP_EAGER_PARTS=2 timeout 200 build_g/test_gpu_c2 --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests comm2 rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
run() {  # name, env...
  local n=$1; shift
  env "$@" timeout 90 build_g/moeflow_c2 bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-100 | sed -E "s/^/$n /" | tee -a $R/log
}
for i in 1 2; do
  run A X=0
  run B MOEFLOW_EP_EAGER_PARTS=2
  run C MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1
  run A X=0
  run D MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1 MOEFLOW_EP_EAGER_FIRST=300
  run E MOEFLOW_EP_EAGER_PARTS=3 MOEFLOW_EP_EAGER_COMM2=1
  run F MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1 MOEFLOW_EP_EAGER=0.8
  echo "t=$SECONDS" | tee -a $R/log
done
MOEFLOW_EP_TRACE=1 MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1 timeout 60 build_g/moeflow_c2 bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf c2.tgz r && rm -rf r
