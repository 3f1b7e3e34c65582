#!/bin/bash
# x2 (session 20): the host enqueues the ranking and the eager pack before
# the routing messages' NCCL group (MOEFLOW_EP_PACK_FIRST, default on) or
# after (=0). EP tests, bench dispatch alternating (also with 4 routings),
# a trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_pf.gz test_gpu_pf.gz && chmod +x moeflow_pf test_gpu_pf; cd ..
SECONDS=0
timeout 200 build_g/test_gpu_pf --gtest_filter='*Ep*' > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
run() {  # name, env...
  local n=$1; shift
  env "$@" timeout 90 build_g/moeflow_pf bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-150 | sed -E "s/^/$n /" | tee -a $R/log
}
for i in 1 2 3; do
  run old MOEFLOW_EP_PACK_FIRST=0
  run new X=0
  echo "t=$SECONDS" | tee -a $R/log
done
for i in 1 2; do
  MOEFLOW_EP_PACK_FIRST=0 timeout 90 build_g/moeflow_pf bench dispatch --backend nccl --iters 20 --no-sweep --routings 4 > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-150 | sed -E "s/^/old-r4 /" | tee -a $R/log
  timeout 90 build_g/moeflow_pf bench dispatch --backend nccl --iters 20 --no-sweep --routings 4 > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-150 | sed -E "s/^/new-r4 /" | tee -a $R/log
done
MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_pf bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf pf.tgz r && rm -rf r
