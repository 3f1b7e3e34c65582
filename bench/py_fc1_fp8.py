"""FC1 of the blockwise FP8 MLP with FC2's input quantized in the GEMM's
epilogue (``grouped_mlp_fp8_fc1_forward``) against the same two ops one
after the other (``grouped_gemm_fp8_forward``, then ``activation_quantize``
of its h), timed in alternation (A B B A) in one process, with the GEMM
alone and the quantize pass alone beside them. Rows: the layer cases'
tokens x top-k split mildly unevenly over the experts (multiples of 16),
SwiGLU with GLU halves, probs. TFLOP/s count FC1's 2 R H N1.

    PYTHONPATH=build/python:bench python3 bench/py_fc1_fp8.py [--json FILE] [--case NAME]
"""
import argparse
import json

import torch

import moeflow.ops as mf
from layer_cases import CASES
from peer_timing import bench_ms, split


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--case", action="append")
    ap.add_argument("--glu-interleave", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "glu_interleave": args.glu_interleave, "cases": {}}
    for name, T, H, F, E, K, _ in CASES:
        if args.case and name not in args.case:
            continue
        R = T * K
        seg = split(E, R)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), seg.cumsum(0)]).to(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(R, H, device=dev, generator=g).bfloat16()
        w = (torch.randn(E * 2 * F, H, device=dev, generator=g) / H ** 0.5).bfloat16()
        xq, xs = mf.quantize(x, "e4m3", "1x128")
        wq, ws = mf.quantize(w, "e4m3", "128x128")
        wq, ws = wq.view(E, 2 * F, H), ws.view(E, 2 * F // 128, H // 128)
        del x, w
        probs = torch.rand(R, device=dev, generator=g) + 0.25
        act = dict(probs=probs, activation="swiglu", glu_interleave=args.glu_interleave)
        h = mf.grouped_gemm_fp8_forward(xq, xs, wq, ws, offsets)

        def fused():
            return mf.grouped_mlp_fp8_fc1_forward(xq, xs, wq, ws, offsets, **act)

        def two_ops():
            hh = mf.grouped_gemm_fp8_forward(xq, xs, wq, ws, offsets)
            return mf.activation_quantize(hh, offsets=offsets, **act)

        got, want = fused(), two_ops()
        same = (torch.equal(got[0].view(torch.int16), mf.grouped_gemm_fp8_forward(
            xq, xs, wq, ws, offsets).view(torch.int16)) and
            torch.equal(got[1].view(torch.uint8), want[0].view(torch.uint8)) and
            torch.equal(got[2], want[1]))
        del got, want
        runs = {"fused": [], "two_ops": []}
        for order in ("fused", "two_ops", "two_ops", "fused"):
            runs[order].append(bench_ms(fused if order == "fused" else two_ops, iters=20))
        gemm_ms = bench_ms(lambda: mf.grouped_gemm_fp8_forward(xq, xs, wq, ws, offsets),
                           iters=20)
        quant_ms = bench_ms(lambda: mf.activation_quantize(h, offsets=offsets, **act), iters=20)
        flop = 2 * R * H * 2 * F
        f_ms = sum(runs["fused"]) / 2
        t_ms = sum(runs["two_ops"]) / 2
        res = {"rows": R, "H": H, "F": F, "E": E, "bitwise_equal": same,
               "fused_ms": runs["fused"], "two_ops_ms": runs["two_ops"],
               "gemm_ms": gemm_ms, "activation_quantize_ms": quant_ms,
               "fused_tflops": flop / f_ms / 1e9, "gemm_tflops": flop / gemm_ms / 1e9,
               "ratio": t_ms / f_ms}
        out["cases"][name] = res
        print(f"{name}: rows {R}, fused {f_ms:.3f} ms ({res['fused_tflops']:.0f} TFLOP/s), "
              f"gemm + activation_quantize {t_ms:.3f} ms ({gemm_ms:.3f} + {quant_ms:.3f}), "
              f"{res['ratio']:.3f}x, bitwise equal: {same}", flush=True)
        del xq, xs, wq, ws, h, probs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
