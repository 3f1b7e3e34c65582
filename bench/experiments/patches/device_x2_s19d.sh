#!/bin/bash
# x2 (session 19): the eager piece with the routing changing every call
# (bench dispatch --routings 4), eager 0.7 against 0, nccl; nvlink beside.
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_rt3.gz && chmod +x moeflow_rt3; cd ..
SECONDS=0
for i in 1 2; do
  for v in 0.7:1 0.7:4 0:4; do
    IFS=: read e n <<< "$v"
    MOEFLOW_EP_EAGER=$e timeout 90 build_g/moeflow_rt3 bench dispatch --backend nccl --routings $n --iters 20 --no-sweep --json $R/bench_nccl_${e}_${n}_$i.json > $R/bench.log 2>&1
    grep -E "rank 0" $R/bench.log | sed -E 's/^/eager '$e' routings '$n' /' | cut -c1-150 | tee -a $R/log
  done
done
timeout 90 build_g/moeflow_rt3 bench dispatch --backend nvlink --routings 4 --iters 20 --no-sweep --json $R/bench_nvlink_4.json > $R/bench.log 2>&1
grep -E "rank 0" $R/bench.log | sed -E 's/^/nvlink routings 4 /' | cut -c1-150 | tee -a $R/log
echo "t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf s19d.tgz r && rm -rf r
