#!/bin/bash
# build_g/build_variant.sh NAME "-DFLAGS ..."  (sources as they are; run after a normal ninja build)
# Compiles ep.cu with the flags and relinks by hand: ninja would recompile the
# object (its deps log keeps the object's mtime).
set -e
export PATH=/usr/local/cuda/bin:$PATH
cd /work/main/build
eval "$(cat /tmp/epcmd.txt) $2"
ninja -t commands tests/test_gpu | grep -E 'ar qc libmoeflow.a' > /tmp/v_ar.sh
ninja -t commands tests/test_gpu | grep -E '\-o tests/test_gpu ' > /tmp/v_link_t.sh
ninja -t commands moeflow | grep -E '\-o moeflow ' > /tmp/v_link_m.sh
bash /tmp/v_ar.sh && bash /tmp/v_link_t.sh && bash /tmp/v_link_m.sh
nm -C libmoeflow.a 2>/dev/null | grep -c 'nvl::' > /dev/null
gzip -c moeflow > ../build_g/moeflow_$1.gz
gzip -c tests/test_gpu > ../build_g/test_gpu_$1.gz
