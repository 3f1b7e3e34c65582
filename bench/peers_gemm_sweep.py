"""torch._grouped_mm on the rows-per-expert sweep of `moeflow bench gemm --sweep`
(same splits: uniform R rows per expert, or skewed ~1/(e+1) rounded to 16),
forward and wgrad (a bf16 dW per expert), plus the bytes a forward must move
(A, W, C once), for the memory bound.

    python3 bench/peers_gemm_sweep.py [--experts 32] [--k 2048] [--n 1536] [--rows R ...] [--json FILE]
"""
import argparse, json
import torch
from peer_timing import bench_ms


def sweep_split(E, R, skewed):
    if not skewed:
        return [R] * E
    z = sum(1.0 / (e + 1) for e in range(E))
    s = [int(E * R / (e + 1) / z / 16) * 16 for e in range(E)]
    s[0] += E * R - sum(s)
    return s




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096],
                    help="rows per expert to sweep")
    ap.add_argument("--json")
    args = ap.parse_args()
    E, K, N = args.experts, args.k, args.n
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "experts": E, "K": K, "N": N, "cases": {}}
    W = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
    for skewed in (False, True):
        for R in args.rows:
            sizes = sweep_split(E, R, skewed)
            M = sum(sizes)
            offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
            A = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ms = bench_ms(lambda: torch._grouped_mm(A, W.transpose(-2, -1), offs=offs), iters=20, warm=5)
            name = f"{'skew' if skewed else 'unif'}-{R}"
            flops = 2 * M * K * N
            moved = (M * K + E * N * K + M * N) * 2
            # wgrad (bf16 dW per expert, as in autograd): dC^T A with the groups
            # splitting the reduction rows.
            dC = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            ms_w = bench_ms(lambda: torch._grouped_mm(dC.t(), A, offs=offs), iters=20, warm=5)
            out["cases"][name] = {"torch_grouped_mm_TFLOPs": flops / ms / 1e9,
                                  "torch_grouped_mm_GBps": moved / ms / 1e6, "bytes": moved,
                                  "torch_grouped_mm_wgrad_TFLOPs": flops / ms_w / 1e9}
            print(f"{name:10s} torch._grouped_mm {flops / ms / 1e9:7.1f} TFLOP/s  ({moved / ms / 1e6:6.0f} GB/s of A+W+C)"
                  f"  wgrad {flops / ms_w / 1e9:7.1f} TFLOP/s")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
