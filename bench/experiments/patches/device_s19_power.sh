#!/bin/bash
# One GPU (session 19): is the qwen3 fused FC1's extra cost the power cap?
# SM clock, power and throttle reasons sampled every 20 ms through bench gemm
# on qwen3-fc1 (long timing loops), stdout lines time-stamped.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
cd build_g && gunzip -kf moeflow_rt3.gz && chmod +x moeflow_rt3; cd ..
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee $OUT/r/log
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown,clocks_throttle_reasons.sw_thermal_slowdown --format=csv,nounits -lms 20 > $OUT/r/smi.csv 2>&1 &
SMI=$!
sleep 1
stdbuf -oL -eL build_g/moeflow_rt3 bench gemm --case qwen3-fc1 --iters 400 2>&1 | while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done | tee $OUT/r/gemm.log | cut -c1-120 | tee -a $OUT/r/log
sleep 1; kill $SMI
wc -l $OUT/r/smi.csv | tee -a $OUT/r/log
cd $OUT && tar czf pw.tgz r && rm -rf r
