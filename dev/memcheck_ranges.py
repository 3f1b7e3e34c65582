#!/usr/bin/env python3
"""Group compute-sanitizer's 'Invalid write' reports by the allocation they
name and print each group's address span, beside the arena layout and
exchange ranges that MOEFLOW_EP_DEBUG_RANGES=1 makes the nccl EP backend print.

    MOEFLOW_EP_DEBUG_RANGES=1 compute-sanitizer --tool memcheck \
        build/tests/test_gpu --gtest_filter=MultiGpuEp.* > log.txt 2>&1
    python3 dev/memcheck_ranges.py log.txt
"""
import re
import sys
from collections import defaultdict

spans = defaultdict(lambda: [None, None, 0])
acc = None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Access to (0x[0-9a-f]+) is out of bounds", line)
    if m:
        acc = int(m.group(1), 16)
        continue
    m = re.search(r"nearest allocation at (0x[0-9a-f]+) of size ([0-9,]+)", line)
    if m and acc is not None:
        base = int(m.group(1), 16)
        s = spans[(base, m.group(2))]
        s[0] = acc if s[0] is None else min(s[0], acc)
        s[1] = acc + 16 if s[1] is None else max(s[1], acc + 16)
        s[2] += 1
        acc = None
    if line.startswith("[ep rank"):
        print(line.rstrip())
for (base, size), (lo, hi, n) in spans.items():
    print(f"allocation {base:#x} ({size} bytes): {n} writes of 16 bytes, offsets [{lo - base}, {hi - base})")
