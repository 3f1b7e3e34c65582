"""FP8 1x128 quantization of activation-shaped bf16 tensors through
moeflow.ops: rowwise (``quantize``), columnwise (``quantize(...,
columnwise=True)``, the wgrad's operand layout) and both from one read
(``quantize_rowwise_columnwise``), the tensorwise codes of expert groups
(``quantize_group_rows``: x read twice; with ``transposed``, the codes and
their transpose from the second pass; with the amax given, that pass
alone), the codes' transpose (``transpose_codes``, the tensorwise
wgrad's operands) and the columnwise codes of FP8 rows
(``requantize_columnwise``, against dequantizing them into bf16 rows and
quantizing those columnwise); and the expert weights' 128 x 128 codes
(``quantize(..., "128x128")``), W^T's codes for the dgrad (straight from
W with ``quantize_rowwise_columnwise(..., rowwise=False,
scaling="128x128")``, or W's codes then ``transpose_codes``) and both from
one read; in GB/s of the bytes each moves, against a device copy (``torch.Tensor.copy_``) timed in
the same process.

    PYTHONPATH=build/python:bench python3 bench/py_quantize.py [--json FILE] [--weights-only]
"""
import argparse
import json

import torch

import moeflow.ops as mf
from peer_timing import bench_ms

# (name, rows, cols): the MLP's x / dY (H) and d(h) (2F) of the dsv3 and mixtral cases
SHAPES = [("dsv3-x", 65536, 7168), ("dsv3-dh", 65536, 4096), ("mixtral-x", 32768, 4096),
          ("mixtral-dh", 32768, 28672)]
# (name, experts, N, K): the dsv3 case's FC1 [E, 2F, H] and FC2 [E, H, F] weights
WEIGHTS = [("dsv3-w1", 32, 4096, 7168), ("dsv3-w2", 32, 7168, 2048)]


def timed(label, ops):
    """{op: ms and GB/s} of (op, fn, bytes moved) triples, printed against the "copy" op."""
    res = {}
    for op, fn, nbytes in ops:
        ms = bench_ms(fn)
        res[op] = {"ms": ms, "GBps": nbytes / ms / 1e6}
    copy = res["copy"]["GBps"]
    print(f"{label}: " + ", ".join(
        f"{op} {r['ms']:.3f} ms {r['GBps']:.0f} GB/s ({r['GBps'] / copy:.0%} of copy)"
        for op, r in res.items()), flush=True)
    return res


def weights(dev, out):
    for name, E, N, K in WEIGHTS:
        w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
        flat = w.view(E * N, K)
        dst = torch.empty_like(w)
        n = E * N * K
        sc = n // (128 * 128) * 4
        q = mf.quantize(flat, "e4m3", "128x128")[0].view(E, N, K)
        ops = [("copy", lambda: dst.copy_(w), 2 * n * 2),
               ("w_codes", lambda: mf.quantize(flat, "e4m3", "128x128"), 3 * n + sc),
               ("w_codes_then_transpose",
                lambda: mf.transpose_codes(mf.quantize(flat, "e4m3", "128x128")[0].view(E, N, K)),
                5 * n + sc),
               ("transpose_codes", lambda: mf.transpose_codes(q), 2 * n),
               ("wt_codes", lambda: mf.quantize_rowwise_columnwise(w, rowwise=False,
                                                                   scaling="128x128"), 3 * n + sc),
               ("both", lambda: mf.quantize_rowwise_columnwise(w, scaling="128x128"),
                4 * n + 2 * sc)]
        out["weights"][name] = timed(f"{name:11s} [{E}, {N}, {K}]", ops)
        del w, flat, dst, q
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--weights-only", action="store_true", help="only the weights' codes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {},
           "weights": {}}
    weights(dev, out)
    for name, M, K in ([] if args.weights_only else SHAPES):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        one = M * K * 2 + M * K + M * K // 128 * 4  # read x, write one orientation
        # The tensorwise recipe's operand: 8 groups, each ending in 16 pad rows
        # (not read); x read twice (the amax, then the codes), codes written.
        offsets = torch.linspace(0, M, 9, device=dev).round().to(torch.int64)
        real = (offsets[1:] - offsets[:-1] - 16).to(torch.int32)
        codes = mf.quantize_group_rows(x, offsets, real)[0]
        amax = x[:1].abs().max().float().reshape(1)  # any amax: the pass's cost
        rq, rs = mf.quantize(x, "e4m3", "1x128")  # FP8 rows as codes (FP8 on the wire)
        ops = [("copy", lambda: dst.copy_(x), 2 * M * K * 2),
               ("rowwise", lambda: mf.quantize(x, "e4m3", "1x128"), one),
               ("columnwise", lambda: mf.quantize(x, "e4m3", "1x128", columnwise=True), one),
               ("both", lambda: mf.quantize_rowwise_columnwise(x), one + M * K + M * K // 128 * 4),
               ("tensorwise_rows", lambda: mf.quantize_group_rows(x, offsets, real),
                2 * M * K * 2 + M * K),
               ("tensorwise_rows_t",
                lambda: mf.quantize_group_rows(x, offsets, real, transposed=True),
                2 * M * K * 2 + 2 * M * K),
               ("tensorwise_codes_t",
                lambda: mf.quantize_group_rows(x, offsets, real, transposed=True, amax=amax),
                M * K * 2 + 2 * M * K),
               ("transpose_codes", lambda: mf.transpose_codes(codes), 2 * M * K),
               # the columnwise codes of FP8 rows: one kernel, or their bf16 rows first
               ("requantize_columnwise", lambda: mf.requantize_columnwise(rq, rs),
                2 * M * K + M * K // 128 * 8),
               ("dequantize_then_columnwise",
                lambda: mf.quantize_rowwise_columnwise(mf.dequantize(rq, rs), rowwise=False),
                2 * M * K + M * K // 128 * 8)]
        out["shapes"][name] = timed(f"{name:11s} [{M}, {K}]", ops)
        del x, dst, codes, amax, rq, rs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
