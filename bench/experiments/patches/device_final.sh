#!/bin/bash
# x2, the closing check of a session: every GPU test in one process, memcheck
# of the two-GPU EP tests (plain buffers: see ep-nccl doc on registered ones),
# bench dispatch of both backends.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd build_g && for f in moeflow_reg.gz test_gpu_reg.gz; do gunzip -f $f; done; chmod +x moeflow_reg test_gpu_reg; cd ..
nvidia-smi -L
SECONDS=0
timeout 240 build_g/test_gpu_reg > $OUT/tests.log 2>&1; echo "tests rc=$? t=$SECONDS"
grep -E "^\[  (PASSED|FAILED)|FAILED|SKIPPED \]|tests ran" $OUT/tests.log | head -12
MOEFLOW_EP_REGISTER=0 timeout 150 compute-sanitizer --tool memcheck --report-api-errors no build_g/test_gpu_reg --gtest_filter='MultiGpuEp.MatchesReference:MultiGpuEpNvlink.MatchesReference' > $OUT/memcheck.log 2>&1
echo "memcheck t=$SECONDS"; grep -E "ERROR SUMMARY|PASSED|FAILED" $OUT/memcheck.log | head -4
for b in nccl nvlink; do
  timeout 60 build_g/moeflow_reg bench dispatch --backend $b --iters 20 --no-sweep --json $OUT/bench_$b.json 2>&1 | grep -E "rank 0|registered"
done
echo "done t=$SECONDS"
