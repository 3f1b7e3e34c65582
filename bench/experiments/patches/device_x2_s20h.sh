#!/bin/bash
# x2 (session 20): NCCL environment variables against the nccl dispatch /
# combine and the in-process all-to-all (main code), each beside the default.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_s20.gz && chmod +x moeflow_s20; cd ..
SECONDS=0
run() {  # name, env...
  local n=$1; shift
  env "$@" timeout 60 build_g/moeflow_s20 bench dispatch --backend nccl --iters 20 --no-sweep > $R/b.log 2>&1
  grep -E "rank 0" $R/b.log | cut -c1-250 | sed -E "s/^/$n /" | tee -a $R/log
  grep -iE "error|warn" $R/b.log | head -3 | tee -a $R/log
}
for i in 1 2; do
  run default X=0
  run ce NCCL_P2P_USE_CUDA_MEMCPY=1
  run simple NCCL_PROTO=Simple
  run chunk2m NCCL_P2P_NVL_CHUNKSIZE=2097152
  run launch-group NCCL_LAUNCH_MODE=GROUP
  run p2pch16 NCCL_MAX_P2P_NCHANNELS=16
  run p2pch64 NCCL_MIN_P2P_NCHANNELS=64 NCCL_MAX_P2P_NCHANNELS=64
  echo "t=$SECONDS" | tee -a $R/log
done
cd $OUT && tar czf h.tgz r && rm -rf r
