#!/bin/bash
# One GPU (session 20, after the bench refactor): bench gemm on the three FC1 cases, then qwen3-fc1
# once more (the fused FC1 in the models' configuration against FC1 alone).
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_s20b.gz && chmod +x moeflow_s20b; cd ..
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee $R/log
SECONDS=0
build_g/moeflow_s20b bench gemm --case dsv3-fc1 --case mixtral-fc1 --case qwen3-fc1 --json $R/gemm_4.json 2>&1 |
  grep -E "^\[|fused|alone" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
build_g/moeflow_s20b bench gemm --case qwen3-fc1 --json $R/gemm_5.json 2>&1 | grep -E "^\[|fused|alone" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s20i.tgz r && rm -rf r
