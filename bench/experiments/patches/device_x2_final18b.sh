#!/bin/bash
# x2 (session 18, last): combine home share 55 % for K/W >= 3 (nvlink):
# all GPU tests on two GPUs, bench dispatch of both backends (JSON), the peer.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz test_gpu_reg.gz && chmod +x moeflow_reg test_gpu_reg; cd ..
SECONDS=0
timeout 300 build_g/test_gpu_reg > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
for i in 1 2; do
  for b in nvlink nccl; do
    timeout 90 build_g/moeflow_reg bench dispatch --backend $b --iters 20 --no-sweep --json $R/bench_${b}_$i.json > $R/bench_$b.log 2>&1
    grep -E "rank 0" $R/bench_$b.log | sed -E 's/^/'$b' /' | tee -a $R/log
  done
done
timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a.json > $R/a2a.log 2>&1
grep -E "GBps|peer_copy" $R/a2a.json | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf f18b.tgz r && rm -rf r
