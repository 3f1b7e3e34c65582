#!/bin/bash
# One GPU (session 18, second call): all single-GPU tests with the MLP API
# test's reference taken at the saved h; on an H200 also the fused-FC1 and
# MLP figures (the H100's were taken in the first call).
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -kf $f; done; chmod +x moeflow_reg test_gpu_reg
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU" | tee $OUT/r/log
SECONDS=0
timeout 300 ./test_gpu_reg > $OUT/r/tests.log 2>&1; echo "tests rc=$? t=$SECONDS" | tee -a $OUT/r/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $OUT/r/tests.log | head -20 | tee -a $OUT/r/log
if echo "$GPU" | grep -q H200; then
  for r in 1 2; do
    ./moeflow_reg bench gemm --case dsv3-fc1 --case mixtral-fc1 --case qwen3-fc1 --json $OUT/r/gemm_$r.json 2>&1 |
      grep -E "^\[|fused|alone" | tee -a $OUT/r/log
  done
  ./moeflow_reg bench mlp --json $OUT/r/mlp.json 2>&1 | grep -E "^\[|forward|keeping" | tee -a $OUT/r/log
  python3 peers_mlp.py --json $OUT/r/peers_mlp.json 2>&1 | tail -20 | tee -a $OUT/r/log
fi
echo "t=$SECONDS" | tee -a $OUT/r/log
cd $OUT && tar czf r.tgz r && rm -rf r
