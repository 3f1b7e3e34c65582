#!/bin/bash
# One GPU (issue 4 figures, best on an H200): the fused FC1 against FC1 alone
# twice, the held-stage window sweep, the MLP step and the torch composite in
# the same call, the GpuMlp tests. Expects build_g/moeflow_reg.gz,
# build_g/test_gpu_reg.gz and build_g/{peers_mlp,peer_timing}.py (copies of
# bench/).
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -kf $f; done; chmod +x moeflow_reg test_gpu_reg
nvidia-smi --query-gpu=name --format=csv | tee $OUT/log
SECONDS=0
for r in 1 2; do
  ./moeflow_reg bench gemm --case dsv3-fc1 --case mixtral-fc1 --case qwen3-fc1 \
    $([ $r = 1 ] && echo --tune-hold 12 16 20 24 28) --json $OUT/gemm_$r.json 2>&1 |
    grep -E "^\[|fused|tune" | tee -a $OUT/log
done
echo "t=$SECONDS" | tee -a $OUT/log
./moeflow_reg bench mlp --json $OUT/mlp.json 2>&1 | grep -E "^\[|forward|keeping" | tee -a $OUT/log
python3 peers_mlp.py --json $OUT/peers_mlp.json 2>&1 | tail -20 | tee -a $OUT/log
timeout 120 ./test_gpu_reg --gtest_filter='GpuMlp.*' 2>&1 | grep -E "OK|FAILED|PASSED" | tee -a $OUT/log
echo "t=$SECONDS" | tee -a $OUT/log
