#!/bin/bash
# x2 (session 20): traces of the eager piece in two parts over two
# communicators (first part 30 % / 15 %), mixtral and dsv3.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_c2.gz && chmod +x moeflow_c2; cd ..
for f in 300 150; do
  MOEFLOW_EP_SELF_ASIDE=0 MOEFLOW_EP_EAGER_PARTS=2 MOEFLOW_EP_EAGER_COMM2=1 MOEFLOW_EP_EAGER_FIRST=$f MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_c2 bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace_$f.log 2>&1
  grep -E "dispatch trace|rank 0" $R/trace_$f.log | cut -c1-330 | tail -9 | tee -a $R/log
done
MOEFLOW_EP_SELF_ASIDE=0 MOEFLOW_EP_TRACE=1 timeout 60 build_g/moeflow_c2 bench dispatch --backend nccl --iters 6 --no-sweep > $R/trace_main.log 2>&1
grep -E "dispatch trace|rank 0" $R/trace_main.log | cut -c1-330 | tail -9 | tee -a $R/log
cd $OUT && tar czf g.tgz r && rm -rf r
