#!/bin/bash
# (MOEFLOW_EP_SPLIT / MOEFLOW_EP_PACKFIRST were env knobs of the session-18 experiment build;
# main has EpOptions::pipeline_first_share instead, and no PACKFIRST: it did not help.)
# x2 (session 18): nccl dispatch, packs enqueued before the count exchange
# (MOEFLOW_EP_PACKFIRST=1) and an uneven two-piece split (MOEFLOW_EP_SPLIT,
# per mille), alternating with the default; EP tests with the variants.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_tr.gz test_gpu_tr.gz && chmod +x moeflow_tr test_gpu_tr; cd ..
SECONDS=0
for v in "MOEFLOW_EP_PACKFIRST=1 MOEFLOW_EP_SPLIT=600" "MOEFLOW_EP_PACKFIRST=0"; do
  echo "== tests $v" | tee -a $R/log
  env $v timeout 120 build_g/test_gpu_tr --gtest_filter='*Ep*:-*Nvlink*' > $R/tests.log 2>&1
  grep -E "^\[  (PASSED|FAILED)|FAILED" $R/tests.log | head | tee -a $R/log
done
for round in 1 2; do
  for v in "A=0" "MOEFLOW_EP_PACKFIRST=1" "MOEFLOW_EP_SPLIT=600" "MOEFLOW_EP_SPLIT=650" "MOEFLOW_EP_PACKFIRST=1 MOEFLOW_EP_SPLIT=600" "MOEFLOW_EP_PACKFIRST=1 MOEFLOW_EP_SPLIT=650"; do
    echo "== $v round $round t=$SECONDS" | tee -a $R/log
    env $v timeout 60 build_g/moeflow_tr bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
    grep -E "rank 0|rror" $R/b.log | tee -a $R/log
  done
done
echo "== trace PACKFIRST SPLIT=600" | tee -a $R/log
MOEFLOW_EP_PACKFIRST=1 MOEFLOW_EP_SPLIT=600 MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_tr bench dispatch --backend nccl --iters 4 --no-sweep > $R/trace.log 2>&1
grep trace $R/trace.log | grep dispatch | tail -6 | tee -a $R/log
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf sp.tgz r && rm -rf r
