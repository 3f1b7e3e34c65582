"""The grouped expert MLP through the Python package (moeflow.ops.grouped_mlp,
forward + backward under torch autograd) beside the PyTorch composite of
bench/peers_mlp.py, same cases, row splits and timing, one process: what the
Python wrapper costs against `moeflow bench mlp` (C++), and the speed-up a
PyTorch user sees. Two ways to get the weight gradients, each for both:
returned as .grad (bf16; moeflow computes them in float32 and casts), and
accumulated into float32 main_grad (moeflow: fused into its wgrad GEMM,
Megatron's gradient-accumulation fusion; torch: .grad added to main_grad).
The timed steps add into the .grad of the steps before them, as the
micro-batches of one optimizer step do (moeflow: in the wgrad GEMM, and
by autograd in the "grad_added_by_autograd" rows); with
--clear-grads every step starts from .grad None instead (a step after
zero_grad(set_to_none=True)). Memory: the peak a step allocates beyond what
exists before it, from .grad None (peak_extra_MiB), and without --clear-grads
also with the .grad of earlier steps present (peak_extra_grads_present_MiB).

    PYTHONPATH=build/python:bench python3 bench/py_mlp.py [--json FILE] [--case NAME]
        [--precision fp8-blockwise|fp8-tensorwise [--fp8-weight-cache]] [--fp8-wgrad]
        [--clear-grads] [--profile [--top N] [--timeline]]
"""
import argparse
import json

import torch
import torch.nn.functional as F

import moeflow.ops as mf
from peer_timing import bench_ms
from peer_timing import split
from peers_mlp import CASES
from py_layer import kernel_sum_ms
from py_layer import kernel_timeline


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--case", action="append")
    ap.add_argument("--precision", action="append", choices=("fp8-blockwise", "fp8-tensorwise"),
                    help="also time moeflow.ops.grouped_mlp with this FP8 recipe (.grad)")
    ap.add_argument("--fp8-weight-cache", action="store_true",
                    help="FP8 recipes: also time them with fp8_weight_cache=True, the weights "
                         "unchanged (steady: quantized once) and new in every step (cleared: "
                         "quantized once a step, blockwise both orientations from one read)")
    ap.add_argument("--fp8-wgrad", action="store_true",
                    help="also time fp8_wgrad=True (weight gradients in FP8): fp8-blockwise on "
                         "the same rows with each expert padded to 128, beside the recipe "
                         "without it on that layout; fp8-tensorwise on the same rows")
    ap.add_argument("--clear-grads", action="store_true",
                    help="every step starts with the gradients None (else each step adds into "
                         "the .grad of the ones before it)")
    ap.add_argument("--profile", action="store_true",
                    help="print each moeflow step's kernel-time sum and its largest kernels")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--timeline", action="store_true",
                    help="with --profile: also print each moeflow step's kernels in launch order")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    for name, E, M, H, Fd in CASES:
        if args.case and name not in args.case:
            continue
        counts = split(E, M)
        offs32 = torch.cumsum(counts, 0).to(torch.int32).to(dev)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]).to(dev)
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w1 = (torch.randn(E, 2 * Fd, H, device=dev, dtype=torch.bfloat16) / H ** 0.5).requires_grad_()
        w2 = (torch.randn(E, H, Fd, device=dev, dtype=torch.bfloat16) / Fd ** 0.5).requires_grad_()
        probs = torch.rand(M, device=dev, dtype=torch.float32)
        dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        flops = 3 * 2 * M * H * (3 * Fd)

        def torch_step():
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs32)
            a = (F.silu(h[:, :Fd]) * h[:, Fd:] * probs[:, None]).to(torch.bfloat16)
            torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs32).backward(dy)

        def torch_main_step():  # the composite with float32 main gradients, unfused
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs32)
            a = (F.silu(h[:, :Fd]) * h[:, Fd:] * probs[:, None]).to(torch.bfloat16)
            torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs32).backward(dy)
            for w in (w1, w2):
                w.main_grad.add_(w.grad)
                w.grad = None

        def mf_step():
            mf.grouped_mlp(x, w1, w2, offsets=offsets, probs=probs).backward(dy)

        def mf_autograd_adds_step():  # the weight gradients returned, autograd adds them
            mf.grouped_mlp(x, w1, w2, offsets=offsets, probs=probs,
                           accumulate_into_grad=False).backward(dy)

        def mf_main_step():
            mf.grouped_mlp(x, w1, w2, offsets=offsets, probs=probs,
                           accumulate_into_main_grad=True).backward(dy)

        def fp8_step(recipe, cache=False, clear=False, wgrad8=False, into_grad=True):
            def step():
                if clear:  # a training step: the weights changed since the last one
                    mf.clear_fp8_weight_cache(w1, w2)
                mf.grouped_mlp(x, w1, w2, offsets=offsets, probs=probs, precision=recipe,
                               fp8_weight_cache=cache, fp8_wgrad=wgrad8,
                               accumulate_into_grad=into_grad,
                               align=16).backward(dy)  # split(): multiples of 16
            return step

        recipes = args.precision or []
        blockwise_wgrad = args.fp8_wgrad and "fp8-blockwise" in recipes
        tensorwise_wgrad = args.fp8_wgrad and "fp8-tensorwise" in recipes
        if blockwise_wgrad:  # the same rows, each expert's starting at a multiple of 128
            padded = (counts + 127) // 128 * 128
            offsets128 = torch.cat([torch.zeros(1, dtype=torch.int64),
                                    torch.cumsum(padded, 0)]).to(dev)
            real128 = counts.to(torch.int32).to(dev)
            idx = torch.cat([int(o) + torch.arange(int(c))
                             for o, c in zip(offsets128[:-1].cpu(), counts)]).to(dev)
            M128 = int(padded.sum())
            x128 = torch.zeros(M128, H, device=dev, dtype=torch.bfloat16)
            x128[idx] = x.detach()
            x128.requires_grad_()
            p128 = torch.zeros(M128, device=dev)
            p128[idx] = probs
            dy128 = torch.zeros(M128, H, device=dev, dtype=torch.bfloat16)
            dy128[idx] = dy

        def fp8_128_step(wgrad8, cache=False, clear=False):
            def step():
                if clear:
                    mf.clear_fp8_weight_cache(w1, w2)
                x128.grad = None
                mf.grouped_mlp(x128, w1, w2, offsets=offsets128, real_rows=real128, probs=p128,
                               precision="fp8-blockwise", fp8_weight_cache=cache,
                               fp8_wgrad=wgrad8, align=128).backward(dy128)
            return step

        res = {}
        steps = [("torch", torch_step), ("moeflow", mf_step),
                 ("torch_main_grad", torch_main_step), ("moeflow_main_grad", mf_main_step)]
        if not args.clear_grads:  # .grad added by autograd instead of the wgrad GEMM
            steps += [("moeflow_grad_added_by_autograd", mf_autograd_adds_step)]
        steps += [("moeflow_" + r, fp8_step(r)) for r in args.precision or []]
        if args.fp8_weight_cache:
            for r in args.precision or []:
                steps += [("moeflow_" + r + "_cached", fp8_step(r, True)),
                          ("moeflow_" + r + "_cached_new_weights", fp8_step(r, True, True))]
        for c, (cache, clear) in (("", (False, False)), ("_cached", (True, False)),
                                  ("_cached_new_weights", (True, True))):
            if c and not args.fp8_weight_cache:
                continue
            if blockwise_wgrad:
                steps += [("moeflow_fp8-blockwise_align128" + c, fp8_128_step(False, cache, clear)),
                          ("moeflow_fp8-blockwise_wgrad" + c, fp8_128_step(True, cache, clear))]
            if tensorwise_wgrad:  # the default rows: one scale needs no 128-row blocks
                steps += [("moeflow_fp8-tensorwise_wgrad" + c,
                           fp8_step("fp8-tensorwise", cache, clear, True))]
                if not c and not args.clear_grads:  # .grad added by autograd instead
                    steps += [("moeflow_fp8-tensorwise_wgrad_grad_added_by_autograd",
                               fp8_step("fp8-tensorwise", False, False, True, False))]
        def cleared(fn):
            def step():
                x.grad = w1.grad = w2.grad = None
                fn()
            return step

        if args.clear_grads:
            steps = [(key, cleared(fn)) for key, fn in steps]
        out["grads"] = "cleared every step" if args.clear_grads else "accumulated over the steps"
        for key, fn in steps:
            if key.endswith("main_grad"):
                w1.main_grad = torch.zeros(w1.shape, device=dev)
                w2.main_grad = torch.zeros(w2.shape, device=dev)
            x.grad = w1.grad = w2.grad = None
            fn()
            torch.cuda.synchronize()
            x.grad = w1.grad = w2.grad = None
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            ms = bench_ms(fn)
            res[key] = {"fwd_bwd_ms": ms, "TFLOPs": flops / ms / 1e9, "peak_extra_MiB": peak}
            if not args.clear_grads:  # a micro-batch after the first: the .grad exist
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                res[key]["peak_extra_grads_present_MiB"] = (
                    (torch.cuda.max_memory_allocated() - base) / 2 ** 20)
            if args.profile and key.startswith("moeflow"):
                total, by_name = kernel_sum_ms(fn)
                res[key]["kernel_sum_ms"] = total
                print(f"{name:10s} {key}: step {ms:.2f} ms, kernels {total:.2f} ms", flush=True)
                for kn, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
                    print(f"    {t:8.3f} ms  {kn[:110]}", flush=True)
                if args.timeline:
                    tl = kernel_timeline(fn)
                    res[key]["timeline"] = tl
                    for st, kn, t in tl:
                        print(f"    @{st / 1e3:8.3f} ms {t:8.3f} ms  {kn[:100]}", flush=True)
            if key.endswith("main_grad"):
                del w1.main_grad, w2.main_grad
        out["cases"][name] = res
        for tk, mk, what in (("torch", "moeflow", ".grad (bf16)"),
                             ("torch_main_grad", "moeflow_main_grad", "main_grad (fp32)")):
            t, m = res[tk], res[mk]
            print(f"{name:10s} weight grads into {what:16s}: torch {t['fwd_bwd_ms']:7.2f} ms, "
                  f"moeflow.ops {m['fwd_bwd_ms']:7.2f} ms, {t['fwd_bwd_ms'] / m['fwd_bwd_ms']:.2f}x;"
                  f" peak extra {t['peak_extra_MiB']:.0f} / {m['peak_extra_MiB']:.0f} MiB",
                  flush=True)
        variants = list(recipes)
        if blockwise_wgrad:
            variants += ["fp8-blockwise_align128", "fp8-blockwise_wgrad"]
        if tensorwise_wgrad:
            variants += ["fp8-tensorwise_wgrad"]
        for r in [p + c for p in variants
                  for c in ([""] + (["_cached", "_cached_new_weights"]
                                    if args.fp8_weight_cache else []))]:
            f8 = res["moeflow_" + r]
            print(f"{name:10s} {r}: {f8['fwd_bwd_ms']:7.2f} ms, "
                  f"{res['moeflow']['fwd_bwd_ms'] / f8['fwd_bwd_ms']:.2f}x moeflow bf16, "
                  f"{res['torch']['fwd_bwd_ms'] / f8['fwd_bwd_ms']:.2f}x torch; peak extra "
                  f"{f8['peak_extra_MiB']:.0f} MiB", flush=True)
        u = res.get("moeflow_grad_added_by_autograd")
        if u is not None:
            print(f"{name:10s} bf16, .grad added by autograd instead of the GEMM: "
                  f"{u['fwd_bwd_ms']:7.2f} ms", flush=True)
        u = res.get("moeflow_fp8-tensorwise_wgrad_grad_added_by_autograd")
        if u is not None:
            print(f"{name:10s} fp8-tensorwise_wgrad, .grad added by autograd instead of the GEMM: "
                  f"{u['fwd_bwd_ms']:7.2f} ms", flush=True)
        del x, w1, w2, dy
        if blockwise_wgrad:
            del x128, dy128
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
