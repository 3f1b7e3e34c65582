"""The MoE layer step from PyTorch: ``moeflow.MoELayer`` forward + backward
(router included, plain ``.grad`` weight gradients) beside the same layer
written with torch ops, on the same inputs and weights, one process.

The torch composite (the peer): the router GEMM in float32, Megatron-Core's
router in torch ops (topk, softmax or sigmoid with expert bias and
group-limited choice, the switch aux loss), permute by a stable argsort of
the expert ids, torch._grouped_mm for FC1 and FC2, SwiGLU times the prob,
and unpermute by index_add_ into float32.

Cases: the layer shapes of the MLP benchmark (`moeflow bench mlp`: the same
rows per step). Reported: forward + backward time (CUDA-event median of
steps each followed by a synchronisation, so the host's time before the
first large kernel counts; and "back to back": ten steps between two events,
as a training loop that does not synchronise every step runs them), the
peak memory the step allocates beyond its inputs and parameters, and with
``--profile`` the sum of the step's kernel times (torch.profiler) against
the step's time, for one step after a synchronisation and per step of
ten run back to back (the steady clock; also their profiled span per step
against the kernels' sum of the same window, which no clock difference
between windows enters). Every step starts from ``.grad`` None (a step after
``zero_grad(set_to_none=True)``); with ``--accumulate`` each adds into the
``.grad`` of the steps before it, as the micro-batches of one optimizer
step do. ``--precision fp8-tensorwise`` (or fp8-blockwise, repeatable)
also times the same layer with FP8 expert GEMMs (its weights copied from
the bf16 layer; ``--fp8-wgrad``, ``--fp8-weight-cache`` as MoELayer's
options), and with ``--ablate-fused-quantize`` each FP8 layer once more
with the tokens (tensorwise: and dout) permuted into 16-bit rows first and
those quantized (the path before permute_quantize and
unpermute_backward_quantize took the FP8 recipes).
``--ablate-recompute-permute`` times moeflow's step once more keeping the
permuted rows for FC1's weight gradient (``recompute_permute=False``; A B
B A). Every step's "saved" figure is what its forward keeps for backward
(saved tensors and outputs). ``--ablate-router-split`` times moeflow's step once more with the router
GEMM's bf16 split in torch ops (five ops and a concatenation per layout)
instead of the one-kernel split (A B B A). ``--router`` times the router
alone at DeepSeek-V3's shape (T 8192, E 256, top-8, 8 groups / top-4,
sigmoid + expert bias), forward and backward, against the torch router,
and the router GEMM (``ops.router_logits``) against ``linear(x.float(),
w)`` at four shapes.

    PYTHONPATH=build/python:bench python3 bench/py_layer.py [--json FILE] [--profile [--trace FILE]]
        [--router] [--case NAME] [--top N] [--memory-snapshot FILE] [--align N]
        [--ablate-router-gemm] [--ablate-router-split] [--ablate-recompute-permute]
        [--accumulate] [--precision P [--fp8-wgrad]
        [--fp8-weight-cache] [--ablate-fused-quantize]]
"""
import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

import moeflow
import moeflow.ops as mf
from moeflow import _C, _mlp_io
from moeflow._ops_common import _stream
from moeflow import _router_ops
from moeflow._router_ops import _router_logits_float32
from layer_cases import AUX, CASES
from peer_timing import bench_ms, saved_mib, steady_ms, step_stats


def torch_router(logits, K, score_function="softmax", num_groups=0, group_topk=0,
                 use_expert_bias=False, expert_bias=None, topk_scaling_factor=None):
    """Megatron-Core's topk_routing_with_score_function + the switch aux
    loss, in torch ops."""
    T, E = logits.shape

    def topk(scores):
        if group_topk:
            gs = scores.view(T, num_groups, -1).topk(K // group_topk, dim=-1)[0].sum(-1)
            gidx = gs.topk(group_topk, dim=-1)[1]
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
            smask = gmask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
            scores = scores.masked_fill(~smask.bool(), float("-inf"))
        return scores.topk(K, dim=1)

    if score_function == "softmax":
        top, ids = topk(logits)
        probs = torch.softmax(top, dim=-1, dtype=torch.float32)
        s = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, ids = topk(scores + expert_bias)
            top = scores.gather(1, ids)
        else:
            top, ids = topk(scores)
        probs = top / (top.sum(-1, keepdim=True) + 1e-20)
        s = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    if topk_scaling_factor:
        probs = probs * topk_scaling_factor
    tpe = torch.bincount(ids.reshape(-1), minlength=E)
    aux = (s.sum(0) * tpe).sum() * (E * AUX / (K * T * T))
    return ids, probs, tpe, aux


def torch_layer(layer, x, K, opts):
    """out [T, H], aux: the composite with the layer's parameters."""
    T, H = x.shape
    Fd = layer.ffn_hidden_size
    logits = F.linear(x.float(), layer.router_weight)
    ids, probs, tpe, aux = torch_router(logits, K, expert_bias=layer.expert_bias, **opts)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(tpe, 0).to(torch.int32)
    xs = x[tok]
    h = torch._grouped_mm(xs, layer.fc1_weight.transpose(-2, -1), offs=offs)
    a = (F.silu(h[:, :Fd]) * h[:, Fd:] * probs.reshape(-1)[order, None]).to(x.dtype)
    y = torch._grouped_mm(a, layer.fc2_weight.transpose(-2, -1), offs=offs)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tok, y.float())
    return out.to(x.dtype), aux


def torch_split_bf16(t, parts, along_columns):
    """_router_ops._split_bf16 in torch ops (the ablation's path): each part
    the rounding of what the previous ones left, then the blocks concatenated."""
    ps, r = [], t
    for i in range(3):
        ps.append(r.to(torch.bfloat16))
        if i < 2:
            r = r - ps[-1]
    return torch.cat([ps[int(d)] for d in parts], 1 if along_columns else 0)


def kernel_sum_ms(fn, trace=None):
    """(the sum of one step's kernel times, {kernel name: its total}), in ms
    (torch.profiler); with ``trace``, the step's timeline (host and device)
    as a Chrome trace."""
    return kernel_profile(fn, trace)[:2]


def kernel_profile(fn, trace=None, steps=1):
    """kernel_sum_ms's two results and the step's idle_gaps; with ``steps``
    > 1, that many steps run back to back (no synchronisation between them,
    so the GPU runs at its steady clock) and every figure is per step."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in evs:
        t = (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) / 1e3
        name = short_name(e.name)
        by_name[name] = by_name.get(name, 0.0) + t / steps
    span, idle, gaps = idle_gaps(evs)
    return sum(by_name.values()), by_name, (span / steps, idle / steps, gaps)


def kernel_timeline(fn):
    """One step's kernels in launch order: [(start us from the first, name,
    ms)] (torch.profiler), after one unprofiled step."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    return [(e.time_range.start - t0, short_name(e.name),
             (e.time_range.end - e.time_range.start) / 1e3) for e in evs]


def idle_gaps(evs, top=6):
    """The GPU's idle time inside the profiled step: (span ms, idle ms, the
    largest gaps as (us, kernel before, kernel after))."""
    iv = sorted((e.time_range.start, e.time_range.end, short_name(e.name)) for e in evs)
    if not iv:
        return 0.0, 0.0, []
    gaps, end, prev = [], iv[0][1], iv[0][2]
    for s, e, n in iv[1:]:
        if s > end:
            gaps.append((s - end, prev[:60], n[:60]))
        if e > end:
            end, prev = e, n
    span = (end - iv[0][0]) / 1e3
    return span, sum(g[0] for g in gaps) / 1e3, sorted(gaps, reverse=True)[:top]


def gemm_rates(by_name, rows, H, Fd):
    """TFLOP/s of moeflow's grouped GEMM kernels in a layer step (SwiGLU):
    FC1 forward (the fused kernel), FC2 forward, the two dgrads, the two
    wgrads, each from its kernels' summed time and the routed rows' FLOPs."""
    fc1, fc2 = 2.0 * rows * H * 2 * Fd, 2.0 * rows * Fd * H
    groups = {"fc1 fwd": (fc1, ("tma_kernel<__nv_bfloat16, __nv_bfloat16, 0", "EpiMlpFc1")),
              "fc2 fwd": (fc2, ("tma_kernel<__nv_bfloat16, __nv_bfloat16, 0", "EpiIdentity")),
              "dgrad": (fc1 + fc2, ("tma_kernel<__nv_bfloat16, __nv_bfloat16, 1",)),
              "wgrad": (fc1 + fc2, ("tma_kernel<__nv_bfloat16, __nv_bfloat16, 2",))}
    out = {}
    for label, (flops, keys) in groups.items():
        ms = sum(t for n, t in by_name.items() if all(k in n for k in keys))
        if ms > 0:
            out[label] = flops / ms / 1e9
    return out


def short_name(name):
    """A kernel's name without its parameter list, cut to 160 characters
    (the template arguments of moeflow's grouped GEMM kept: its mode)."""
    name = name.replace("(anonymous namespace)::", "")
    if "(" in name and not name.startswith("Memset") and not name.startswith("Memcpy"):
        depth = 0
        for i, c in enumerate(name):
            depth += c in "<"
            depth -= c in ">"
            if c == "(" and depth == 0 and i > 0:
                name = name[:i]
                break
    return name[:160]


def graph_us(step, n=10, iters=10):
    """GPU time per call of step, n calls replayed in one CUDA graph (after
    three on a side stream), the median of ``iters`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            step()
    us = 1e3 * bench_ms(graph.replay, iters=iters) / n
    del graph
    return us


def bench_router(out, profile=False):
    dev = torch.device("cuda")
    T, E, K = 8192, 256, 8
    opts = dict(score_function="sigmoid", num_groups=8, group_topk=4, topk_scaling_factor=2.5)
    logits = torch.randn(T, E, device=dev, requires_grad=True)
    bias = torch.randn(E, device=dev) * 1e-2
    dprobs = torch.randn(T, K, device=dev)
    res = {}
    r = mf.router(logits, K, expert_bias=bias, aux_loss_coeff=AUX, **opts)
    res["moeflow_fwd_us"] = 1e3 * bench_ms(
        lambda: mf.router(logits.detach(), K, expert_bias=bias, aux_loss_coeff=AUX, **opts),
        iters=50)

    one = torch.ones((), device=dev)

    def mf_bwd():
        logits.grad = None
        r = mf.router(logits, K, expert_bias=bias, aux_loss_coeff=AUX, **opts)
        torch.autograd.backward([r.probs, r.aux_loss], [dprobs, one])
    res["moeflow_fwd_bwd_us"] = 1e3 * bench_ms(mf_bwd, iters=50)
    res["moeflow_bwd_us"] = res["moeflow_fwd_bwd_us"] - res["moeflow_fwd_us"]

    # The kernels alone: 20 forwards (no autograd) replayed in one CUDA
    # graph, time per forward (kernels and the gaps between them).
    with torch.no_grad():
        res["moeflow_graph_fwd_us"] = graph_us(
            lambda: mf.router(logits.detach(), K, expert_bias=bias, aux_loss_coeff=AUX, **opts),
            n=20, iters=20)
    # The same for 20 forward + backward steps (autograd captured, the
    # gradient returned; the backward's time is the difference).
    def mf_grad():  # a fresh leaf: its gradient's stream is the capturing one
        lg = logits.detach().requires_grad_(True)
        r = mf.router(lg, K, expert_bias=bias, aux_loss_coeff=AUX, **opts)
        torch.autograd.grad([r.probs, r.aux_loss], [lg], [dprobs, one])

    res["moeflow_graph_fwd_bwd_us"] = graph_us(mf_grad, n=20, iters=20)
    res["moeflow_graph_bwd_us"] = res["moeflow_graph_fwd_bwd_us"] - res["moeflow_graph_fwd_us"]
    logits.grad = None

    def t_fwd():
        with torch.no_grad():
            torch_router(logits, K, use_expert_bias=True, expert_bias=bias, **opts)
    res["torch_fwd_us"] = 1e3 * bench_ms(t_fwd, iters=50)

    def t_bwd():
        logits.grad = None
        ids, probs, tpe, aux = torch_router(logits, K, expert_bias=bias, **opts)
        torch.autograd.backward([probs, aux], [dprobs, one])
    res["torch_fwd_bwd_us"] = 1e3 * bench_ms(t_bwd, iters=50)
    res["torch_bwd_us"] = res["torch_fwd_bwd_us"] - res["torch_fwd_us"]
    if profile:
        for key, fn in (("moeflow_fwd", lambda: mf.router(logits.detach(), K, expert_bias=bias,
                                                          aux_loss_coeff=AUX, **opts)),
                        ("moeflow_fwd_bwd", mf_bwd)):
            total, by_name = kernel_sum_ms(fn)
            res[key + "_kernels_us"] = {n: round(1e3 * t, 2) for n, t in by_name.items()}
            print(f"    {key}: kernels {1e3 * total:.1f} us: " + ", ".join(
                f"{n[:60]} {1e3 * t:.1f}" for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])),
                flush=True)
    del r
    out["router_dsv3"] = res
    print(f"router dsv3 (T {T}, E {E}, top-{K}, groups 8/4, sigmoid+bias): "
          f"moeflow fwd {res['moeflow_fwd_us']:.1f} us (in a graph {res['moeflow_graph_fwd_us']:.1f}),"
          f" bwd {res['moeflow_bwd_us']:.1f} us (in a graph {res['moeflow_graph_bwd_us']:.1f}); "
          f"torch fwd {res['torch_fwd_us']:.1f} us, bwd {res['torch_bwd_us']:.1f} us", flush=True)


def bench_router_gemm(out):
    """The router GEMM (logits in float32) forward + backward, both gradients:
    ops.router_logits against linear(x.float(), w) in torch, in CUDA graphs."""
    dev = torch.device("cuda")
    res = {}
    for T, H, E in ((8192, 7168, 256), (4096, 7168, 256), (8192, 7168, 32), (16384, 4096, 8)):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, H, device=dev) * H ** -0.5
        dl = torch.randn(T, E, device=dev)

        def step(f):
            xl = x.detach().requires_grad_(True)
            wl = w.detach().requires_grad_(True)
            torch.autograd.grad([f(xl, wl)], [xl, wl], [dl])

        fns = {"moeflow": lambda: step(mf.router_logits),
               "torch": lambda: step(lambda a, b: F.linear(a.float(), b))}
        r = {k + "_us": graph_us(f) for k, f in fns.items()}
        # Eagerly, one call then a synchronisation: the host's time included.
        r.update({k + "_eager_us": 1e3 * bench_ms(f, iters=20) for k, f in fns.items()})
        res[f"T{T}_H{H}_E{E}"] = r
        print(f"router GEMM T {T} H {H} E {E}, fwd+bwd in a graph: moeflow "
              f"{r['moeflow_us']:.1f} us, torch linear(x.float(), w) {r['torch_us']:.1f} us, "
              f"{r['torch_us'] / r['moeflow_us']:.2f}x; eager {r['moeflow_eager_us']:.1f} / "
              f"{r['torch_eager_us']:.1f} us", flush=True)
    out["router_gemm"] = res


@contextlib.contextmanager
def unfused_quantize():
    """The FP8 layers' rows quantized the way they were before the fused
    ops: the tokens permuted into 16-bit rows, then quantize_group_rows of
    those (tensorwise; and dout's rows by unpermute_backward, then the same)
    or their 1x128 quantize (blockwise), so that the ablation runs the same
    node otherwise."""
    keep_fwd = _mlp_io.PermuteSource.forward_tensorwise
    keep_blk = _mlp_io.PermuteSource.forward_blockwise
    keep_bwd = mf.unpermute_backward_quantize

    def forward_blockwise(self, x, probs, transposed=False):
        rows, rp = self.forward(x, probs)
        if transposed:  # both orientations from the rows (FP8 wgrads)
            q, s, q_t, s_t = mf.quantize_rowwise_columnwise(rows)
            return q, s, rp, (q_t, s_t)
        q, s = mf.quantize(rows, "e4m3", "1x128")
        return q, s, rp

    def forward_tensorwise(self, x, probs, transposed):
        rows, rp = self.forward(x, probs)
        got = mf.quantize_group_rows(rows, self.plan.expert_row_offsets,
                                     self.plan.tokens_per_expert, transposed=transposed)
        return got[0], got[1], (got[2] if transposed else None), rp

    keep_cols = _mlp_io.columnwise_codes
    cols = {}  # blockwise: dY's columnwise codes, made beside its rowwise ones

    def unpermute_backward_quantize(dout, plan, probs=None, fp8_format="e4m3",
                                    pow2_scales=False, scaling="1x128", transposed=False):
        assert probs is None
        dy = dout.new_empty(plan.capacity_rows, dout.shape[1])
        _C.unpermute_backward(dout, plan._view, None, None, dy, None, _stream(dout))
        if scaling == "tensorwise":
            return mf.quantize_group_rows(dy, plan.expert_row_offsets, plan.tokens_per_expert,
                                          transposed=transposed)
        # blockwise: both orientations from the 16-bit rows, as before the fusion
        q, s, q_t, s_t = mf.quantize_rowwise_columnwise(dy)
        cols.clear()
        cols[dout.data_ptr()] = (q_t, s_t)
        return q, s

    def columnwise_codes(x, plan, fp8_format="e4m3", pow2_scales=False):
        got = cols.pop(x.data_ptr(), None)
        return got if got is not None else keep_cols(x, plan, fp8_format, pow2_scales)

    _mlp_io.PermuteSource.forward_tensorwise = forward_tensorwise
    _mlp_io.PermuteSource.forward_blockwise = forward_blockwise
    mf.unpermute_backward_quantize = unpermute_backward_quantize
    _mlp_io.columnwise_codes = columnwise_codes
    try:
        yield
    finally:
        _mlp_io.PermuteSource.forward_tensorwise = keep_fwd
        _mlp_io.PermuteSource.forward_blockwise = keep_blk
        mf.unpermute_backward_quantize = keep_bwd
        _mlp_io.columnwise_codes = keep_cols


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--case", action="append")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ablate-router-gemm", action="store_true",
                    help="also time moeflow's step with the router GEMM through float32 GEMMs")
    ap.add_argument("--ablate-router-split", action="store_true",
                    help="also time moeflow's step with the router GEMM's split in torch ops")
    ap.add_argument("--ablate-recompute-permute", action="store_true",
                    help="also time moeflow's step with recompute_permute=False")
    ap.add_argument("--router", action="store_true")
    ap.add_argument("--top", type=int, default=10, help="with --profile: kernels listed per step")
    ap.add_argument("--align", type=int, default=16,
                    help="MoELayer's align (rows per expert padded to a multiple of it)")
    ap.add_argument("--memory-snapshot", help="write each case's moeflow step memory history "
                                              "(torch.cuda.memory._dump_snapshot), FILE with the "
                                              "case name inserted")
    ap.add_argument("--accumulate", action="store_true",
                    help="the steps add into the .grad of the steps before them (micro-batches "
                         "of one optimizer step) instead of starting from .grad None")
    ap.add_argument("--trace", help="with --profile: write each case's moeflow step as a Chrome "
                                    "trace, FILE with the case name inserted")
    ap.add_argument("--precision", action="append", default=[],
                    choices=["fp8-tensorwise", "fp8-blockwise"],
                    help="also time the layer with FP8 expert GEMMs (repeatable)")
    ap.add_argument("--fp8-wgrad", action="store_true", help="FP8 layers: fp8_wgrad=True")
    ap.add_argument("--compile", action="store_true",
                    help="also time both layers under torch.compile (Inductor; moeflow's with "
                         "fullgraph=True, the torch composite's with its graph breaks), "
                         "A B B A against the eager step")
    ap.add_argument("--fp8-weight-cache", action="store_true",
                    help="FP8 layers: fp8_weight_cache=True")
    ap.add_argument("--ablate-fused-quantize", action="store_true",
                    help="with --precision: also time each FP8 layer with the rows "
                         "permuted in 16 bits, then quantized (A B B A)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "moeflow": moeflow.__version__, "align": args.align,
           "grads": "accumulated over the steps" if args.accumulate else "cleared every step",
           "fp8": {"precision": args.precision, "fp8_wgrad": args.fp8_wgrad,
                   "fp8_weight_cache": args.fp8_weight_cache},
           "cases": {}}
    if args.router:
        bench_router(out, args.profile)
        bench_router_gemm(out)
    for name, T, H, Fd, E, K, opts in CASES:
        if args.case and name not in args.case:
            continue
        torch.manual_seed(0)
        layer = moeflow.MoELayer(H, Fd, E, K, aux_loss_coeff=AUX, align=args.align, device=dev,
                                 **opts)
        layer.train()
        if layer.expert_bias is not None:
            layer.expert_bias.normal_(0, 1e-2)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        params = [x] + list(layer.parameters())
        topts = {k: v for k, v in opts.items() if k != "use_expert_bias"}

        def clear():  # a training step after zero_grad(set_to_none=True)
            if args.accumulate:  # micro-batches: each step adds into the .grad before it
                return
            for p in params:
                p.grad = None

        def mf_step():
            clear()
            layer(x).backward(dy)

        def torch_step():
            clear()
            o, aux = torch_layer(layer, x, K, topts)
            torch.autograd.backward([o, aux], [dy, torch.ones((), device=dev)])

        def mf_f32_router_step():  # the router GEMM through float32 GEMMs (ablation)
            keep = mf.router_logits
            mf.router_logits = _router_logits_float32
            try:
                mf_step()
            finally:
                mf.router_logits = keep

        def mf_torch_split_step():  # the router GEMM's split in torch ops (ablation)
            keep = _router_ops._split_bf16
            _router_ops._split_bf16 = torch_split_bf16
            try:
                mf_step()
            finally:
                _router_ops._split_bf16 = keep

        @contextlib.contextmanager
        def rows_kept():  # recompute_permute=False (ablation)
            layer.recompute_permute = False
            try:
                yield
            finally:
                layer.recompute_permute = True

        def mf_rows_kept_step():
            with rows_kept():
                mf_step()

        def mf_rows_kept_fwd():
            with rows_kept():
                return layer(x)

        forwards = {"torch": lambda: torch_layer(layer, x, K, topts), "moeflow": lambda: layer(x),
                    "moeflow_rows_kept": mf_rows_kept_fwd}
        res = {}
        steps = [("torch", torch_step), ("moeflow", mf_step)]
        if args.compile:
            torch._dynamo.reset()
            mf_compiled = torch.compile(layer, fullgraph=True)
            torch_compiled = torch.compile(torch_layer)

            def mf_compiled_step():
                clear()
                mf_compiled(x).backward(dy)

            def torch_compiled_step():
                clear()
                o, aux = torch_compiled(layer, x, K, topts)
                torch.autograd.backward([o, aux], [dy, torch.ones((), device=dev)])

            steps += [("moeflow_compiled", mf_compiled_step), ("moeflow_c1", mf_step),
                      ("moeflow_c2", mf_step), ("moeflow_compiled_2", mf_compiled_step),
                      ("torch_compiled", torch_compiled_step)]
        fp8_layers = []
        for prec in args.precision:
            layer8 = moeflow.MoELayer(H, Fd, E, K, aux_loss_coeff=AUX, align=args.align,
                                      device=dev, precision=prec, params_dtype=torch.bfloat16,
                                      fp8_wgrad=args.fp8_wgrad,
                                      fp8_weight_cache=args.fp8_weight_cache, **opts)
            layer8.load_state_dict(layer.state_dict())
            layer8.train()
            fp8_layers.append(layer8)
            params += list(layer8.parameters())

            def fp8_step(layer8=layer8):
                clear()
                layer8(x).backward(dy)

            def fp8_unfused_step(fp8_step=fp8_step):
                with unfused_quantize():
                    fp8_step()

            steps.append((f"moeflow_{prec}", fp8_step))
            forwards[f"moeflow_{prec}"] = lambda layer8=layer8: layer8(x)
            if args.ablate_fused_quantize:
                steps += [(f"moeflow_{prec}_unfused", fp8_unfused_step),
                          (f"moeflow_{prec}_unfused_2", fp8_unfused_step),
                          (f"moeflow_{prec}_2", fp8_step)]
        if args.ablate_router_gemm:  # A B B A against the default (drift cancels)
            steps += [("moeflow_float32_router_gemm", mf_f32_router_step), ("moeflow_1", mf_step),
                      ("moeflow_2", mf_step), ("moeflow_float32_router_gemm_2", mf_f32_router_step)]
        if args.ablate_recompute_permute:  # A B B A against the default (drift cancels)
            steps += [("moeflow_rows_kept", mf_rows_kept_step), ("moeflow_r1", mf_step),
                      ("moeflow_r2", mf_step), ("moeflow_rows_kept_2", mf_rows_kept_step)]
        if args.ablate_router_split:  # A B B A against the default (drift cancels)
            steps += [("moeflow_torch_split", mf_torch_split_step), ("moeflow_s1", mf_step),
                      ("moeflow_s2", mf_step), ("moeflow_torch_split_2", mf_torch_split_step)]
        for key, fn in steps:
            ms, peak = step_stats(fn, params)
            res[key] = {"fwd_bwd_ms": ms, "peak_extra_MiB": peak}
            if key in forwards:
                res[key]["saved_MiB"] = saved_mib(forwards[key])
            if key in ("torch", "moeflow") or (key.startswith("moeflow_fp8")
                                               and not key.endswith("_2")):
                res[key]["back_to_back_ms"] = steady_ms(fn)
            if args.profile and key in ("torch", "moeflow"):
                trace = None
                if args.trace and key == "moeflow":
                    stem, dot, ext = args.trace.rpartition(".")
                    trace = f"{stem}-{name}.{ext}" if dot else f"{args.trace}-{name}"
                total, by_name, (span, idle, gaps) = kernel_profile(fn, trace)
                res[key]["kernel_sum_ms"] = total
                # ten steps back to back (steady clocks): the kernels' sum and
                # the profiled span per step, from the same window
                b2b, _, (b2b_span, b2b_idle, _) = kernel_profile(fn, steps=10)
                res[key]["back_to_back_kernel_sum_ms"] = b2b
                res[key]["back_to_back_idle_ms"] = b2b_idle
                res[key]["back_to_back_span_ms"] = b2b_span
                res[key]["profiled_span_ms"], res[key]["idle_ms"] = span, idle
                res[key]["largest_gaps_us"] = [[round(g, 1), a, b] for g, a, b in gaps]
                if key == "moeflow":
                    res[key]["gemm_tflops"] = gemm_rates(by_name, T * K, H, Fd)
                top = sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]
                res[key]["top_kernels_ms"] = {n: round(t, 4) for n, t in top}
            if args.profile and key.startswith("moeflow_fp8") and not key.endswith("_2"):
                total, by_name, (span, idle, gaps) = kernel_profile(fn)
                res[key]["kernel_sum_ms"], res[key]["idle_ms"] = total, idle
                top = sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]
                res[key]["top_kernels_ms"] = {n: round(t, 4) for n, t in top}
            for p in params:
                p.grad = None
            if args.memory_snapshot and key == "moeflow":
                stem, dot, ext = args.memory_snapshot.rpartition(".")
                torch.cuda.memory._record_memory_history(max_entries=100000)
                fn()
                torch.cuda.synchronize()
                torch.cuda.memory._dump_snapshot(f"{stem}-{name}.{ext}" if dot else
                                                 f"{args.memory_snapshot}-{name}")
                torch.cuda.memory._record_memory_history(enabled=None)
                for p in params:
                    p.grad = None
        out["cases"][name] = res
        t, m = res["torch"], res["moeflow"]
        line = (f"{name:10s} layer fwd+bwd: torch {t['fwd_bwd_ms']:7.2f} ms, moeflow "
                f"{m['fwd_bwd_ms']:7.2f} ms, {t['fwd_bwd_ms'] / m['fwd_bwd_ms']:.2f}x; peak extra "
                f"{t['peak_extra_MiB']:.0f} / {m['peak_extra_MiB']:.0f} MiB, saved for backward "
                f"{t['saved_MiB']:.0f} / {m['saved_MiB']:.0f} MiB")
        tb, mb = t["back_to_back_ms"], m["back_to_back_ms"]
        line += f"; back to back {tb:.2f} / {mb:.2f} ms, {tb / mb:.2f}x"
        if "moeflow_rows_kept" in res:
            ab = [(res["moeflow_rows_kept" + i]["fwd_bwd_ms"],
                   res["moeflow_r" + (i[1:] if i else "1")]["fwd_bwd_ms"]) for i in ("", "_2")]
            r = res["moeflow_rows_kept"]
            line += ("; rows kept / permuted again (A B B A): " + ", ".join(
                f"{a:.2f} / {b:.2f} ms" for a, b in ab) + f", rows kept: saved "
                f"{r['saved_MiB']:.0f} MiB, peak extra {r['peak_extra_MiB']:.0f} MiB")
        if "moeflow_compiled" in res:
            ab = [(res["moeflow_compiled" + i]["fwd_bwd_ms"],
                   res["moeflow_c" + (i[1:] if i else "1")]["fwd_bwd_ms"]) for i in ("", "_2")]
            tc = res["torch_compiled"]
            line += ("; torch.compile: moeflow compiled / eager (A B B A): " + ", ".join(
                f"{a:.2f} / {b:.2f} ms" for a, b in ab) +
                f", peak extra {res['moeflow_compiled']['peak_extra_MiB']:.0f} MiB; torch "
                f"composite compiled {tc['fwd_bwd_ms']:.2f} ms "
                f"({tc['fwd_bwd_ms'] / ab[0][0]:.2f}x moeflow compiled), peak extra "
                f"{tc['peak_extra_MiB']:.0f} MiB")
        if "moeflow_torch_split" in res:
            ab = [(res["moeflow_torch_split" + i]["fwd_bwd_ms"],
                   res["moeflow_s" + (i[1:] if i else "1")]["fwd_bwd_ms"]) for i in ("", "_2")]
            line += "; router split in torch ops / one kernel (A B B A): " + ", ".join(
                f"{a:.2f} / {b:.2f} ms" for a, b in ab)
        if "moeflow_float32_router_gemm" in res:
            ab = [(res["moeflow_float32_router_gemm" + i]["fwd_bwd_ms"],
                   res["moeflow" + (i or "_1")]["fwd_bwd_ms"]) for i in ("", "_2")]
            line += "; router GEMM float32 / split (A B B A): " + ", ".join(
                f"{a:.2f} / {b:.2f} ms" for a, b in ab)
        if args.profile:
            line += (f"; kernels {t['kernel_sum_ms']:.2f} / {m['kernel_sum_ms']:.2f} ms "
                     f"(step / kernels {m['fwd_bwd_ms'] / m['kernel_sum_ms']:.3f}); back to back "
                     f"kernels {t['back_to_back_kernel_sum_ms']:.2f} / "
                     f"{m['back_to_back_kernel_sum_ms']:.2f} ms, GPU idle "
                     f"{m['back_to_back_idle_ms']:.2f} ms per step (step / kernels "
                     f"{mb / m['back_to_back_kernel_sum_ms']:.3f}; profiled span / kernels "
                     f"{m['back_to_back_span_ms'] / m['back_to_back_kernel_sum_ms']:.3f})")
        print(line, flush=True)
        for key, r in res.items():
            if key.startswith("moeflow_fp8"):
                print(f"    {key}: {r['fwd_bwd_ms']:7.2f} ms ({t['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x "
                      f"torch, {m['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x moeflow bf16), peak extra "
                      f"{r['peak_extra_MiB']:.0f} MiB" +
                      (f", saved {r['saved_MiB']:.0f} MiB" if "saved_MiB" in r else "") +
                      (f", back to back {r['back_to_back_ms']:.2f} ms ({tb / r['back_to_back_ms']:.2f}x "
                       f"torch)" if "back_to_back_ms" in r else ""), flush=True)
                for n, kt in r.get("top_kernels_ms", {}).items():
                    print(f"      {kt:8.3f} ms  {n[:120]}", flush=True)
        if args.profile:
            rates = res["moeflow"]["gemm_tflops"]
            print("    grouped GEMMs (TFLOP/s of the T*K rows): " + ", ".join(
                f"{k} {v:.0f}" for k, v in rates.items()), flush=True)
            for n, t in res["moeflow"]["top_kernels_ms"].items():
                print(f"    {t:8.3f} ms  {n[:150]}", flush=True)
            m = res["moeflow"]
            print(f"    profiled step: span {m['profiled_span_ms']:.2f} ms, GPU idle "
                  f"{m['idle_ms']:.2f} ms; largest gaps:", flush=True)
            for g, a, b in m["largest_gaps_us"]:
                print(f"      {g:8.1f} us after {a} / before {b}", flush=True)
        del layer, x, dy, params, fp8_layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
