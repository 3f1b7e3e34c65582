#!/bin/bash
# x2 (session 18): the nccl backend with pipeline_first_share = 0.65 by
# default: EP tests (a two-piece round added), memcheck of the nccl rounds
# (plain buffers), bench dispatch of both backends (JSON), the a2a peer.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz test_gpu_reg.gz && chmod +x moeflow_reg test_gpu_reg; cd ..
nvidia-smi -L | tee $R/log
SECONDS=0
timeout 150 build_g/test_gpu_reg --gtest_filter='*Ep*' > $R/tests_ep.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests_ep.log | head -20 | tee -a $R/log
for b in nccl nvlink; do
  timeout 90 build_g/moeflow_reg bench dispatch --backend $b --iters 20 --no-sweep --json $R/bench_$b.json > $R/bench_$b.log 2>&1
  grep -E "rank 0|registered" $R/bench_$b.log | tee -a $R/log
done
timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a.json > $R/a2a.log 2>&1
grep -E "GBps|peer_copy" $R/a2a.json | tee -a $R/log
echo "memcheck t=$SECONDS" | tee -a $R/log
MOEFLOW_EP_REGISTER=0 timeout 200 compute-sanitizer --tool memcheck build_g/test_gpu_reg --gtest_filter='MultiGpuEp.MatchesReference:GpuEp.OneRankMatchesReference' > $R/memcheck.log 2>&1
echo "memcheck rc=$?" | tee -a $R/log
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/memcheck.log | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf f18.tgz r && rm -rf r
