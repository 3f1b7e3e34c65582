#!/bin/bash
# (MOEFLOW_EP_SPLIT / MOEFLOW_EP_PACKFIRST were env knobs of the session-18 experiment build;
# main has EpOptions::pipeline_first_share instead, and no PACKFIRST: it did not help.)
# x2 (session 18): the two-piece split of the nccl backend, 500 (default) /
# 650 / 700 / 750 per mille, and NCCL's NVLink chunk size, alternating.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_tr.gz && chmod +x moeflow_tr; cd ..
SECONDS=0
for round in 1 2 3; do
  for v in "A=0" "MOEFLOW_EP_SPLIT=650" "MOEFLOW_EP_SPLIT=700" "MOEFLOW_EP_SPLIT=750" "NCCL_P2P_NVL_CHUNKSIZE=1048576 MOEFLOW_EP_SPLIT=650"; do
    echo "== $v round $round t=$SECONDS" | tee -a $R/log
    env $v timeout 60 build_g/moeflow_tr bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
    grep -E "rank 0|rror" $R/b.log | sed -E 's/GB\/s out \(NCCL a2a same bytes//; s/a2a of the bf16 token rows.*//' | tee -a $R/log
  done
done
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf sp2.tgz r && rm -rf r
