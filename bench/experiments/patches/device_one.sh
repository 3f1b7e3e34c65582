#!/bin/bash
# One GPU (session 17): all single-GPU tests, bench mlp (the vectorised
# recompute), and on an H200 also the fused-FC1 figures and the torch MLP.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -kf $f; done; chmod +x moeflow_reg test_gpu_reg
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU" | tee $OUT/log
SECONDS=0
timeout 240 ./test_gpu_reg > $OUT/tests.log 2>&1; echo "tests rc=$? t=$SECONDS"
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $OUT/tests.log | head -20
./moeflow_reg bench mlp --json $OUT/mlp.json 2>&1 | grep -E "^\[|forward|keeping" | tee -a $OUT/log
if echo "$GPU" | grep -q H200; then
  for r in 1 2; do
    ./moeflow_reg bench gemm --case dsv3-fc1 --case mixtral-fc1 --case qwen3-fc1 --json $OUT/gemm_$r.json 2>&1 |
      grep -E "^\[|fused" | tee -a $OUT/log
  done
  python3 peers_mlp.py --json $OUT/peers_mlp.json 2>&1 | tail -20 | tee -a $OUT/log
fi
echo "t=$SECONDS"
