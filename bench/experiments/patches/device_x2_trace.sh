#!/bin/bash
# x2 (session 18): a finer trace of the nccl dispatch (per-piece packs, the
# host's progress in GPU time), default NCCL settings and 64 CTAs.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_tr.gz && chmod +x moeflow_tr; cd ..
SECONDS=0
for v in "A=1" "NCCL_MIN_CTAS=64"; do
  echo "== $v" | tee -a $R/log
  env $v MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_tr bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace.log 2>&1
  grep -E "rank 0" $R/trace.log | tee -a $R/log
  grep trace $R/trace.log | grep dispatch | tail -4 | tee -a $R/log
  grep trace $R/trace.log | grep combine | tail -2 | tee -a $R/log
done
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf tr.tgz r && rm -rf r
