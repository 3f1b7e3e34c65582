"""torch._grouped_mm on the grouped-GEMM cases of `moeflow bench gemm` (its
peer): forward out = A W_e^T, dgrad dA = dC W_e, wgrad dW_e = dC_e^T A_e
(bf16 out), and the FP8 forward torch has on Hopper (torch._scaled_grouped_mm:
e4m3 with row-wise scales, fast accumulation; `forward_fp8_rowwise`), randn
operands (as moeflow's bench fills them: random values),
mildly uneven rows per expert in multiples of 16 (the same kind of split as
bench_gemm's uneven_split). TFLOP/s of each, median of 20 after 5 warm-ups.

    python3 bench/peers_gemm.py [--json FILE]
"""
import argparse
import json

import torch

from peer_timing import bench_ms, split

# name, experts, rows, K, N (bench/bench_gemm.cpp)
CASES = [("dsv3-fc1", 32, 65536, 7168, 4096), ("dsv3-fc2", 32, 65536, 2048, 7168),
         ("mixtral-fc1", 8, 32768, 4096, 28672), ("qwen3-fc1", 128, 131072, 2048, 1536),
         ("qwen3-fc2", 128, 131072, 768, 2048)]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    for name, E, M, K, N in CASES:
        offs = torch.cumsum(split(E, M), 0).to(torch.int32).to(dev)
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        dc = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * M * K * N
        # Row-wise FP8 (a scale per row of A and per output column of W).
        sa = (a.float().abs().amax(1) / 448.0).clamp(min=1e-12)
        a8 = (a.float() / sa[:, None]).to(torch.float8_e4m3fn)
        sw = (w.float().abs().amax(-1) / 448.0).clamp(min=1e-12)
        w8 = (w.float() / sw[..., None]).to(torch.float8_e4m3fn)
        ops = {"forward": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
               "dgrad": lambda: torch._grouped_mm(dc, w, offs=offs),
               "wgrad": lambda: torch._grouped_mm(dc.t(), a, offs=offs),
               "forward_fp8_rowwise": lambda: torch._scaled_grouped_mm(
                   a8, w8.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                   use_fast_accum=True)}
        res = {}
        for op, fn in ops.items():
            try:
                res[op] = flops / bench_ms(fn, iters=20, warm=5) / 1e9
            except Exception as ex:  # an op torch does not support: say so
                res[op] = f"{type(ex).__name__}: {str(ex)[:120]}"
        out["cases"][name] = res
        print(f"{name:12s} torch._grouped_mm TFLOP/s: " + ", ".join(
            f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()),
            flush=True)
        del a, w, dc, a8, w8
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
