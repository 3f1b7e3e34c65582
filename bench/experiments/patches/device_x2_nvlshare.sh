#!/bin/bash
# x2 (session 18): the nvlink backend's role shares on 2 x H100 at 32 SMs
# (tuned on H200s): dispatch home share, combine home share, alternating.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz && chmod +x moeflow_reg; cd ..
SECONDS=0
for round in 1 2; do
  for v in "A=0" "MOEFLOW_NVL_HOME=50" "MOEFLOW_NVL_HOME=55" "MOEFLOW_NVL_HOME=65" "MOEFLOW_NVL_CHOME=60" "MOEFLOW_NVL_CHOME=65" "MOEFLOW_NVL_CHOME=75" "MOEFLOW_NVL_CHOME=45" "MOEFLOW_NVL_CHOME=55"; do
    echo "== $v round $round t=$SECONDS" | tee -a $R/log
    env $v timeout 60 build_g/moeflow_reg bench dispatch --backend nvlink --iters 20 --no-sweep > $R/b.log 2>&1
    grep -E "rank 0|rror" $R/b.log | sed -E 's/GB\/s out \(NCCL a2a same bytes//; s/a2a of the bf16 token rows.*//' | tee -a $R/log
  done
done
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf nvs.tgz r && rm -rf r
