"""The PyTorch composite of the grouped expert MLP (its peer):
torch._grouped_mm (FC1) + silu(gate) * up * prob + torch._grouped_mm (FC2)
under autograd, forward + backward, on the MLP cases of `moeflow bench mlp`
(same row splits: mildly uneven, multiples of 16, as bench_gemm's
uneven_split). Reports the time of forward + backward and the peak memory
the step allocates beyond its inputs and weights.

    python3 bench/peers_mlp.py [--json FILE]
"""
import argparse, json
import torch
import torch.nn.functional as F
from peer_timing import bench_ms, split

# name, local experts, rows, H, F  (the grouped-GEMM cases of bench/bench_gemm.cpp)
CASES = [("dsv3", 32, 65536, 7168, 2048), ("mixtral", 8, 32768, 4096, 14336),
         ("qwen3-30b", 128, 131072, 2048, 768)]



def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--json"); args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    for name, E, M, H, Fd in CASES:
        offs = torch.cumsum(split(E, M), 0).to(torch.int32).to(dev)
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w1 = (torch.randn(E, 2 * Fd, H, device=dev, dtype=torch.bfloat16) / H ** 0.5).requires_grad_()
        w2 = (torch.randn(E, H, Fd, device=dev, dtype=torch.bfloat16) / Fd ** 0.5).requires_grad_()
        probs = torch.rand(M, 1, device=dev, dtype=torch.float32)
        dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)

        def step():
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            a = (F.silu(h[:, :Fd]) * h[:, Fd:] * probs).to(torch.bfloat16)
            y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
            y.backward(dy)

        res = {}
        try:
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            res["peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            ms = bench_ms(step)
            flops = 3 * 2 * M * H * (3 * Fd)  # fwd + 2x bwd, FC1 (2F) + FC2 (F)
            res["fwd_bwd_ms"] = ms
            res["TFLOPs"] = flops / ms / 1e9
        except Exception as ex:
            res["error"] = str(ex)[:200]
        out["cases"][name] = res
        print(f"{name:10s} torch composite fwd+bwd {res.get('fwd_bwd_ms', float('nan')):8.2f} ms  "
              f"peak extra {res.get('peak_extra_MiB', float('nan')):9.0f} MiB  {res.get('error', '')}", flush=True)
        del x, w1, w2, dy
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
