#!/bin/bash
# (MOEFLOW_EP_METACOMM was an env knob of a session-18 experiment build, not on main:
# the metadata on a split communicator beside the rows; no gain, dropped.)
# x2 (session 18): the routing metadata of the nccl dispatch on a second
# communicator beside the rows (MOEFLOW_EP_METACOMM=1 at group creation) vs
# on comm in front of them; EP tests both ways; a trace.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_mc.gz test_gpu_mc.gz && chmod +x moeflow_mc test_gpu_mc; cd ..
SECONDS=0
for v in "MOEFLOW_EP_METACOMM=1"; do
  echo "== tests $v" | tee -a $R/log
  env $v timeout 120 build_g/test_gpu_mc --gtest_filter='*Ep*:-*Nvlink*' > $R/tests.log 2>&1
  grep -E "^\[  (PASSED|FAILED)|FAILED" $R/tests.log | head | tee -a $R/log
done
for round in 1 2 3; do
  for v in "MOEFLOW_EP_METACOMM=0" "MOEFLOW_EP_METACOMM=1"; do
    echo "== $v round $round t=$SECONDS" | tee -a $R/log
    env $v timeout 60 build_g/moeflow_mc bench dispatch --backend nccl --iters 20 --no-sweep --json $R/b_${v#*=}_$round.json > $R/b.log 2>&1
    grep -E "rank 0|rror" $R/b.log | sed -E 's/GB\/s out \(NCCL a2a same bytes//; s/a2a of the bf16 token rows.*//' | tee -a $R/log
  done
done
echo "== trace METACOMM=1" | tee -a $R/log
MOEFLOW_EP_METACOMM=1 MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_mc bench dispatch --backend nccl --iters 4 --no-sweep > $R/trace.log 2>&1
grep trace $R/trace.log | grep dispatch | tail -8 | tee -a $R/log
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf mcm.tgz r && rm -rf r
