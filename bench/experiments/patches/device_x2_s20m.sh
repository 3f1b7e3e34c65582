#!/bin/bash
# x2 (session 20): memcheck of the bare NCCL probe with one registered arena
# carved into the send and receive buffers (mode 2), plain run first.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
chmod +x build_g/nccl_registered_memcheck
SECONDS=0
timeout 60 build_g/nccl_registered_memcheck 2 2>&1 | tail -2 | tee -a $R/log
timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30 build_g/nccl_registered_memcheck 2 > $R/probe_memcheck_2.log 2>&1
echo "probe arena memcheck rc=$? t=$SECONDS" | tee -a $R/log
grep -E "ERROR SUMMARY|buffers:" $R/probe_memcheck_2.log | tee -a $R/log
cd $OUT && tar czf m.tgz r && rm -rf r
