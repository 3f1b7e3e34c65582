#!/bin/bash
# x2 (session 18): NCCL's p2p channel count for the nccl backend. Does NCCL
# give a peer over NVLink more CTAs (channels) when asked, and do the
# dispatch / combine transfers get closer to the link?
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
R=$OUT/r
cd build_g && gunzip -kf moeflow_reg.gz && chmod +x moeflow_reg; cd ..
nvidia-smi -L | tee $R/log
SECONDS=0
run() {  # name, env...
  local name=$1; shift
  echo "== $name ($*) t=$SECONDS" | tee -a $R/log
  env "$@" timeout 90 build_g/moeflow_reg bench dispatch --backend nccl --iters 20 --no-sweep \
    --json $R/nccl_$name.json > $R/nccl_$name.log 2>&1
  grep -E "rank 0|registered|rror" $R/nccl_$name.log | tee -a $R/log
}
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P timeout 60 build_g/moeflow_reg bench dispatch --backend nccl --iters 2 --no-sweep > $R/debug_default.log 2>&1
grep -iE "channels|p2p|NCCL version" $R/debug_default.log | grep -v "Channel [0-9]*/" | head -12 | tee -a $R/log
run default A=1
run p2p64 NCCL_MIN_P2P_NCHANNELS=64
run ctas64 NCCL_MIN_CTAS=64
run p2p64chunk2m NCCL_MIN_P2P_NCHANNELS=64 NCCL_P2P_NVL_CHUNKSIZE=2097152
NCCL_MIN_P2P_NCHANNELS=64 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P timeout 60 build_g/moeflow_reg bench dispatch --backend nccl --iters 2 --no-sweep > $R/debug_p2p64.log 2>&1
grep -iE "channels|p2p" $R/debug_p2p64.log | grep -v "Channel [0-9]*/" | head -8 | tee -a $R/log
run default2 A=1
echo "== peers default t=$SECONDS" | tee -a $R/log
timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a_default.json > $R/a2a_default.log 2>&1
grep -E "GBps|ms" $R/a2a_default.json | head -12 | tee -a $R/log
echo "== peers p2p64 t=$SECONDS" | tee -a $R/log
NCCL_MIN_P2P_NCHANNELS=64 timeout 100 torchrun --nproc-per-node=2 build_g/a2a_peers.py --json $R/a2a_p2p64.json > $R/a2a_p2p64.log 2>&1
grep -E "GBps|ms" $R/a2a_p2p64.json | head -12 | tee -a $R/log
echo "== done t=$SECONDS" | tee -a $R/log
cd $OUT && tar czf x2.tgz r && rm -rf r
