#!/bin/bash
# x4 / x8 (issue 7): EP tests of both backends on every GPU, memcheck of one,
# bench dispatch (dsv3, qwen3-235b) both backends (+ the SM sweep for nvlink),
# FP8 dispatch, and the torch a2a peer, one call.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -f $f; done; chmod +x moeflow_reg test_gpu_reg; cd ..
nvidia-smi -L
N=$(nvidia-smi -L | wc -l)
SECONDS=0
echo "== tests (*Ep*) W=$N"
timeout 300 build_g/test_gpu_reg --gtest_filter='*Ep*' > $OUT/tests.log 2>&1
grep -E "^\[  (PASSED|FAILED|  OK)|FAILED|tests ran|Failure|differ" $OUT/tests.log | head -40
for b in nvlink nccl; do
  echo "== bench $b t=$SECONDS"
  timeout 150 build_g/moeflow_reg bench dispatch --backend $b --preset dsv3 --preset qwen3-235b --iters 20 --json $OUT/ep_${b}_w$N.json > $OUT/ep_${b}_w$N.log 2>&1
  grep -E "^\[|rank 0|SMs\)|pieces x" $OUT/ep_${b}_w$N.log | cut -c1-260
done
echo "== fp8 nvlink t=$SECONDS"
timeout 90 build_g/moeflow_reg bench dispatch --backend nvlink --fp8 --preset dsv3 --preset qwen3-235b --iters 20 --no-sweep --json $OUT/fp8_nvlink_w$N.json 2>&1 | grep -E "rank 0" | cut -c1-260
echo "== nccl registered t=$SECONDS"
MOEFLOW_EP_REGISTER=1 timeout 90 build_g/moeflow_reg bench dispatch --preset dsv3 --preset qwen3-235b --iters 20 --no-sweep --json $OUT/ep_nccl_reg_w$N.json 2>&1 | grep -E "rank 0" | cut -c1-260
echo "== peers t=$SECONDS"
timeout 120 torchrun --nproc-per-node=$N build_g/a2a_peers.py --json $OUT/a2a_w$N.json 2>&1 | grep -v -i warn | tail -8
echo "== done t=$SECONDS"
