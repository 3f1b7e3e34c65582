#!/usr/bin/env python3
"""Merge `moeflow bench permute --json` and shared/peers/peers.py --json into
the markdown table kept under docs/perf/.

    python3 tools/perf_table.py ours.json peers.json
"""
import json
import sys

# TransformerEngine fused permute+pad on an H200 (shared/BENCHMARKS.md; TE is
# not installed on the GPU machine, so it is quoted, not re-measured).
TE_FUSED_PAD_H200 = {"mixtral": 973, "dsv3": 1075, "qwen3-30b": 917}


def main():
    ours = json.load(open(sys.argv[1]))
    peers = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
    rows = {(r["case"], r["op"]): r for r in ours["rows"]}
    pp = peers.get("permute", {})
    copy_peer = peers.get("ceilings", {}).get("copy_GBps")
    print(f"Device: {ours['device']}; dtype {ours['dtype']}, align {ours['align']}; "
          f"copy ceiling {ours['copy_GBps']:.0f} GB/s (moeflow)"
          + (f", {copy_peer:.0f} GB/s (torch)" if copy_peer else ""))
    print()
    print("| case | plan build (us) | permute+pad GB/s | plan+permute+pad GB/s (of copy) | "
          "torch permute GB/s | ratio | TE fused pad (H200, quoted) | ratio | "
          "unpermute+probs GB/s (of copy) | torch unpermute GB/s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = sorted({c for c, _ in rows if c != "-"}, key=lambda c: ["mixtral", "dsv3", "qwen3-30b"].index(c)
                   if c in ("mixtral", "dsv3", "qwen3-30b") else 9)
    for c in cases:
        plan = rows[(c, "plan build")]["time_us"]
        perm = rows[(c, "permute+pad")]["GBps"]
        e2e = rows[(c, "plan+permute+pad")]
        unp = rows[(c, "unpermute (probs merged)")]
        tp = pp.get(c, {}).get("torch_permute_GBps")
        tu = pp.get(c, {}).get("torch_unpermute_GBps")
        te = TE_FUSED_PAD_H200.get(c)
        f = lambda v: f"{v:.0f}" if v else "-"
        r = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
        print(f"| {c} | {plan:.1f} | {perm:.0f} | {e2e['GBps']:.0f} ({100 * e2e['GBps'] / ours['copy_GBps']:.0f}%) | "
              f"{f(tp)} | {r(e2e['GBps'], tp)} | {f(te)} | {r(e2e['GBps'], te)} | "
              f"{unp['GBps']:.0f} ({100 * unp['GBps'] / ours['copy_GBps']:.0f}%) | {f(tu)} | {r(unp['GBps'], tu)} |")
    print()
    print("Backward ops (GB/s, of copy):")
    print()
    print("| case | permute_backward | unpermute_backward + dprobs |")
    print("|---|---|---|")
    for c in cases:
        pb = rows[(c, "permute_backward")]
        ub = rows[(c, "unpermute_backward+dprobs")]
        print(f"| {c} | {pb['GBps']:.0f} ({100 * pb['GBps'] / ours['copy_GBps']:.0f}%) | "
              f"{ub['GBps']:.0f} ({100 * ub['GBps'] / ours['copy_GBps']:.0f}%) |")


if __name__ == "__main__":
    main()
