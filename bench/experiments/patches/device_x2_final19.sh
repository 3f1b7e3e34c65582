#!/bin/bash
# x2 (session 19, final): all GPU tests on two GPUs, memcheck of the nccl
# EP tests (plain buffers), bench dispatch of both backends (JSON) beside the
# previous main (reg), the torch peer, a trace of the nccl dispatch.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz moeflow_rt.gz test_gpu_rt.gz && chmod +x moeflow_reg moeflow_rt test_gpu_rt; cd ..
SECONDS=0
timeout 300 build_g/test_gpu_rt > $R/tests.log 2>&1
echo "tests rc=$? t=$SECONDS" | tee -a $R/log
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]" $R/tests.log | head -20 | tee -a $R/log
for i in 1 2; do
  for v in reg rt; do
    timeout 90 build_g/moeflow_$v bench dispatch --backend nccl --iters 20 --no-sweep --json $R/bench_nccl_${v}_$i.json > $R/bench.log 2>&1
    grep -E "rank 0" $R/bench.log | sed -E 's/^/nccl '$v' /' | tee -a $R/log
  done
  timeout 90 build_g/moeflow_rt bench dispatch --backend nvlink --iters 20 --no-sweep --json $R/bench_nvlink_rt_$i.json > $R/bench.log 2>&1
  grep -E "rank 0" $R/bench.log | sed -E 's/^/nvlink rt /' | tee -a $R/log
done
timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a.json > $R/a2a.log 2>&1
grep -E "GBps|peer_copy" $R/a2a.json | tee -a $R/log
MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_rt bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
echo "t=$SECONDS" | tee -a $R/log
MOEFLOW_EP_REGISTER=0 timeout 240 compute-sanitizer --tool memcheck --report-api-errors no build_g/test_gpu_rt --gtest_filter='MultiGpuEp.MatchesReference:MultiGpuEp.InvalidIds*:GpuEp.Fp8*' > $R/memcheck.log 2>&1
grep -E "ERROR SUMMARY|PASSED|FAILED" $R/memcheck.log | head | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf f19.tgz r && rm -rf r
