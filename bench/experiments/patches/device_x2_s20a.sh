#!/bin/bash
# x2 (session 20): all GPU tests on two GPUs (current main), bench gemm on the
# three FC1 cases (the models' configuration line, new), bench mlp and the
# torch MLP composite in the same call.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_s20.gz test_gpu_rt5.gz && chmod +x moeflow_s20 test_gpu_rt5; cd ..
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee $R/log
SECONDS=0
timeout 300 build_g/test_gpu_rt5 > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
build_g/moeflow_s20 bench gemm --case dsv3-fc1 --case mixtral-fc1 --case qwen3-fc1 --json $R/gemm_1.json 2>&1 |
  grep -E "^\[|fused|alone" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
build_g/moeflow_s20 bench mlp --json $R/mlp.json 2>&1 | grep -E "^\[|forward|keeping|memory|MiB" | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd build_g && timeout 200 python3 peers_mlp.py --json $R/peers_mlp.json 2>&1 | tail -20 | tee -a $R/log; cd ..
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s20a.tgz r && rm -rf r
