#!/bin/bash
# x2, one call (session 17): registered staging buffers as the nccl default:
# EP tests, both backends' bench with their sweeps, the a2a peer, run --ep.
# Outputs tarred into $OUT/x2b.tgz (the device tool returns 8 files at most).
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && for f in *.gz; do gunzip -f $f; done; chmod +x moeflow_* test_gpu_*; cd ..
nvidia-smi -L
SECONDS=0
echo "== tests (*Ep*)"
timeout 120 build_g/test_gpu_reg --gtest_filter='*Ep*' > $R/tests_ep.log 2>&1
grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran" $R/tests_ep.log | head -20
for b in nccl nvlink; do
  echo "== bench $b sweep t=$SECONDS"
  timeout 150 build_g/moeflow_reg bench dispatch --backend $b --iters 20 --json $R/bench_$b.json > $R/bench_$b.log 2>&1
  grep -E "rank 0|registered|sweep|error" $R/bench_$b.log
done
echo "== bench nccl plain t=$SECONDS"
MOEFLOW_EP_REGISTER=0 timeout 60 build_g/moeflow_reg bench dispatch --iters 20 --no-sweep --json $R/bench_nccl_plain.json > $R/bench_nccl_plain.log 2>&1
grep -E "rank 0|registered" $R/bench_nccl_plain.log
echo "== peers t=$SECONDS"
timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a.json > $R/a2a.log 2>&1
grep -E "GBps|ms" $R/a2a.json | head -12
for b in nccl nvlink; do
  echo "== run --ep $b t=$SECONDS"
  timeout 60 build_g/moeflow_reg run --ep --backend $b --preset qwen3-30b 2>&1 | tail -3
done
echo "== trace nccl t=$SECONDS"
MOEFLOW_EP_TRACE=1 timeout 40 build_g/moeflow_reg bench dispatch --iters 3 --no-sweep > $R/trace.log 2>&1; grep trace $R/trace.log | tail -6
cd $OUT && tar czf x2b.tgz r && rm -rf r
echo "== done t=$SECONDS"
