#!/bin/bash
# x2 (session 20): pieces x overlap-blocks sweep of the nccl dispatch with
# the plan and own rows on the side stream (new) and without (old).
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_sa.gz && chmod +x moeflow_sa; cd ..
SECONDS=0
for i in 1 2; do
  for v in 0 1; do
    MOEFLOW_EP_SELF_ASIDE=$v timeout 120 build_g/moeflow_sa bench dispatch --backend nccl --iters 20 > $R/b.log 2>&1
    grep -E "rank 0|sweep|pieces" $R/b.log | cut -c1-400 | sed -E "s/^/aside=$v /" | tee -a $R/log
    echo "t=$SECONDS" | tee -a $R/log
  done
done
cd $OUT && tar czf sw.tgz r && rm -rf r
