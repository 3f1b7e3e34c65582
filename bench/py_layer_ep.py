"""An expert-parallel MoE layer's training step, moeflow against
Megatron-Core, on W GPUs of one host (one process per GPU):

    torchrun --nproc-per-node=W bench/py_layer_ep.py --case dsv3-4k --json OUT.json

Per rank and case, on the same inputs, routing options and expert shapes:

- ours: ``moeflow.MoELayer(..., ep_group=moeflow.ep.Group(WORLD, ...,
  backend=--backend))``, E/W experts per rank;
- megatron: megatron-core's ``MoELayer`` (TopKRouter, alltoall dispatcher,
  experts per ``--peer-experts``: see bench/peers_megatron.py), if megatron-core
  is importable (``--mcore-path`` or PYTHONPATH); otherwise a message and
  ours alone.

One step = forward + backward of the layer (router, dispatch, experts,
combine; the auxiliary loss's gradient included) with plain ``.grad``
weight gradients, cleared before every step (a step after
zero_grad(set_to_none=True)). Timed with CUDA events after warm-up steps,
every step started together (torch.cuda.synchronize + barrier): the median
per rank of the step and of its forward part, then the slowest rank's; and
"back to back": the same number of steps between two events with no
barrier or synchronisation between them, as a training loop runs them (the
slowest rank's time per step). Peak
memory: torch.cuda.max_memory_allocated over one step, absolute and less
what was allocated before it (parameters, inputs, persistent buffers), the
largest over the ranks. Both count torch's allocator only: moeflow's EP
group buffers (NCCL symmetric memory), its dispatch states (the handles'
pool) and NCCL's own buffers are outside it; what moeflow holds outside
torch's allocator after the steps is reported beside (``ep_buffers_MiB``)
and must be added to its peak for a comparison.

Inputs: uniform in [-1, 1) bf16, a different seed per rank; the router
weights (normal, std 0.02, one seed for every rank) are copied into both
layers, so both route alike from the same logits; the expert weights are
each library's own initialisation (shapes equal, values not).

Cases (tokens per GPU): dsv3-4k / dsv3-8k (H 7168, F 2048, 256 experts,
top-8, sigmoid with expert bias, 8 groups / top-4, scaling 2.5; 4096 / 8192
tokens), qwen3-235b (H 4096, F 1536, 128 experts, top-8 softmax; 8192).

Run ours with moeflow importable (PYTHONPATH=build/python). Progress goes to
stderr; rank 0 prints the table; ``--json`` writes the rows (after every
measurement, so a later failure keeps the earlier rows). A failure of ours
exits non-zero; a failure of the peer is printed and the run goes on.
"""
import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import peers_megatron

SIGMOID = dict(score_function="sigmoid", num_groups=8, group_topk=4, use_expert_bias=True,
               topk_scaling_factor=2.5)
SOFTMAX = dict(score_function="softmax")
# name: tokens per GPU, hidden, FFN, experts (all ranks), top-k, router options
CASES = {
    "dsv3-4k": (4096, 7168, 2048, 256, 8, SIGMOID),
    "dsv3-8k": (8192, 7168, 2048, 256, 8, SIGMOID),
    "qwen3-235b": (8192, 4096, 1536, 128, 8, SOFTMAX),
}
MiB = 2.0 ** 20


def parse_args():
    ap = argparse.ArgumentParser(
        description="Expert-parallel MoE layer step (forward + backward): moeflow vs "
                    "Megatron-Core. Launch with torchrun --nproc-per-node=W.")
    ap.add_argument("--case", action="append", choices=sorted(CASES) + ["all"],
                    help="a case (repeatable; default: all)")
    ap.add_argument("--backend", choices=("nccl", "nvlink", "reference"), default="nvlink",
                    help="moeflow's EP backend (default nvlink; reference: the torch oracle)")
    ap.add_argument("--impl", choices=("both", "ours", "megatron"), default="both",
                    help="what to run (default both)")
    ap.add_argument("--peer-experts", choices=peers_megatron.EXPERTS + ("both",),
                    default="grouped", help="megatron's experts: grouped (TEGroupedMLP on "
                    "torch._grouped_mm, default), sequential (SequentialMLP) or both")
    ap.add_argument("--no-peer-act-fusion", action="store_true",
                    help="megatron without bias_activation_fusion (its torch.compile'd "
                         "weighted SwiGLU): plain torch ops")
    ap.add_argument("--mcore-path", default=os.environ.get("MCORE_PATH"),
                    help="folder holding megatron/ (an unpacked megatron-core wheel); "
                         "default $MCORE_PATH, else the normal import path")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up steps (default 5)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps (default 20)")
    ap.add_argument("--align", type=int, default=16, help="moeflow's rows-per-expert alignment")
    ap.add_argument("--precision", choices=("bf16", "fp8-blockwise"), default="bf16",
                    help="moeflow's expert MLP recipe")
    ap.add_argument("--fp8-wire", action="store_true",
                    help="with --precision fp8-blockwise: an FP8 group, the tokens dispatched "
                         "as their 1x128 e4m3 codes (quantized by the dispatch)")
    ap.add_argument("--fp8-wgrad", action="store_true",
                    help="with an FP8 precision: the weight gradients as FP8 GEMMs too "
                         "(MoELayer's fp8_wgrad; needs --align 128)")
    ap.add_argument("--fp8-weight-cache", action="store_true",
                    help="with an FP8 precision: the weights' codes kept while the weights do "
                         "not change (MoELayer's fp8_weight_cache): the steady state of "
                         "micro-batches between optimizer steps")
    ap.add_argument("--combine-wire", choices=("float32", "bfloat16"), default="float32",
                    help="moeflow's combine wire dtype (moeflow.ep.Group's combine_wire_dtype)")
    ap.add_argument("--capacity-factor", type=float,
                    help="moeflow's receive rows per rank: ceil(T * K * factor) rounded up to "
                         "align (a budget, as install(capacity_factor=) of moeflow.megatron; "
                         "slots past it are dropped and counted); default the worst case "
                         "T * W * min(K, E/W) + padding, which never drops")
    ap.add_argument("--aux-loss-coeff", type=float, default=1e-2,
                    help="switch aux loss coefficient of both layers (0: none)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout-min", type=int, default=10,
                    help="collective timeout: a rank stuck this long aborts the run")
    ap.add_argument("--json", help="write the rows to this file (rank 0)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, one more step under torch.profiler: rank 0 "
                         "prints its kernels' summed time and the largest kernels")
    ap.add_argument("--top", type=int, default=14, help="with --profile: kernels listed")
    ap.add_argument("--trace", help="with --profile: a folder for rank 0's Chrome traces")
    args = ap.parse_args()
    if args.fp8_wire and args.precision != "fp8-blockwise":
        ap.error("--fp8-wire needs --precision fp8-blockwise")
    if (args.fp8_wgrad or args.fp8_weight_cache) and args.precision == "bf16":
        ap.error("--fp8-wgrad and --fp8-weight-cache need an FP8 --precision")
    names = args.case or ["all"]
    args.cases = list(CASES) if "all" in names else list(dict.fromkeys(names))
    return args


class Dist:
    """This process's rank, world size and CUDA device (torchrun's
    environment; one process without it)."""

    def __init__(self, timeout_min):
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
            os.environ.setdefault(k, v)
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ["LOCAL_RANK"])
        if not torch.cuda.is_available():
            sys.exit("py_layer_ep: no CUDA device")
        torch.cuda.set_device(self.local)
        self.dev = torch.device("cuda", self.local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=timeout_min),
                                device_id=self.dev)

    def sync(self):
        """Every rank's work done, and every rank here (the next step starts
        together)."""
        torch.cuda.synchronize()
        dist.barrier(device_ids=[self.local])
        torch.cuda.synchronize()

    def gather(self, values):
        """[W][len(values)] floats: every rank's values."""
        t = torch.tensor(values, dtype=torch.float64, device=self.dev)
        out = torch.empty(self.world * len(values), dtype=torch.float64, device=self.dev)
        dist.all_gather_into_tensor(out, t)
        return out.view(self.world, len(values)).tolist()

    def any(self, flag):
        """True on every rank if ``flag`` is true on some rank."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def log(d, msg):
    if d.rank == 0:
        print(f"[py_layer_ep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def case_inputs(d, name, seed):
    """x [T, H] (requires grad) and dy [T, H], bf16, uniform in [-1, 1),
    this rank's seed; the shared router weight [E, H] float32 (one seed
    for all ranks). The same values for both implementations."""
    T, H, _, E, _, _ = CASES[name]
    g = torch.Generator(device=d.dev).manual_seed(seed + 1000 * (d.rank + 1))
    x = torch.empty(T, H, device=d.dev).uniform_(-1, 1, generator=g).to(torch.bfloat16)
    dy = torch.empty(T, H, device=d.dev).uniform_(-1, 1, generator=g).to(torch.bfloat16)
    g.manual_seed(seed)
    w = torch.empty(E, H, device=d.dev).normal_(0.0, 0.02, generator=g)
    return x.requires_grad_(True), dy, w


def measure(d, fwd, params, x, dy, warmup, iters):
    """Times fwd(x).backward(dy) as a training step: (per-rank [step ms,
    forward ms, peak extra MiB, peak MiB, back-to-back step ms] of this
    rank). The gradients of ``params`` (and x) are cleared before each step.
    Step and forward: medians of steps that start together on every rank
    (a barrier and a synchronisation before each); back to back: ``iters``
    steps between two events with neither, as a training loop runs them."""
    grads = list(params) + [x]

    def clear():
        for p in grads:
            p.grad = None

    for _ in range(warmup):
        clear()
        fwd(x).backward(dy)
    clear()
    gc.collect()
    d.sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd(x).backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    steps, fwds = [], []
    for _ in range(iters):
        clear()
        d.sync()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = fwd(x)
        e1.record()
        out.backward(dy)
        e2.record()
        del out
        torch.cuda.synchronize()
        steps.append(e0.elapsed_time(e2))
        fwds.append(e0.elapsed_time(e1))
    clear()
    d.sync()
    b0, b1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    b0.record()
    for _ in range(iters):
        clear()
        fwd(x).backward(dy)
    b1.record()
    torch.cuda.synchronize()
    clear()
    return [statistics.median(steps), statistics.median(fwds), (peak - base) / MiB, peak / MiB,
            b0.elapsed_time(b1) / iters]


def profile_step(d, args, label, fwd, params, x, dy):
    """With --profile: one step on every rank under torch.profiler; rank 0
    prints the sum of its kernel times against the step's wall time, and the
    largest kernels (bench/py_layer.py's helpers), and returns them for the
    row (``profile_rank0``; None without --profile and on the other ranks).
    The kernels that wait for the other ranks (the first collective's)
    include that wait: the ranks enter the profiler at different times."""
    if not args.profile:
        return None
    try:
        from py_layer import kernel_sum_ms  # imports moeflow
    except ImportError as e:
        log(d, f"--profile skipped for {label}: bench/py_layer.py does not import ({e})")
        return None
    grads = list(params) + [x]

    def step():
        for p in grads:
            p.grad = None
        fwd(x).backward(dy)

    trace = None
    if args.trace and d.rank == 0:
        os.makedirs(args.trace, exist_ok=True)
        trace = os.path.join(args.trace, f"{label}_w{d.world}.json")
    d.sync()
    total, by_name = kernel_sum_ms(step, trace)
    for p in grads:
        p.grad = None
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]
    if d.rank == 0:
        print(f"[profile {label} W={d.world}] kernels of one step (rank 0): {total:.2f} ms",
              file=sys.stderr, flush=True)
        for name, t in top:
            print(f"  {t:8.3f} ms  {name}", file=sys.stderr, flush=True)
    d.sync()
    return {"kernels_ms": total, "top_ms": [[n, t] for n, t in top]} if d.rank == 0 else None


def summarise(per_rank):
    """The row's numbers from every rank's [step, fwd, extra, peak,
    back-to-back step]: the slowest rank's times, the largest peaks, and
    the per-rank lists."""
    cols = list(zip(*per_rank))
    return {"step_ms": max(cols[0]), "fwd_ms": max(cols[1]),
            "back_to_back_ms": max(cols[4]),
            "bwd_ms": max(s - f for s, f in zip(cols[0], cols[1])),
            "peak_extra_MiB": max(cols[2]), "peak_MiB": max(cols[3]),
            "per_rank": {"step_ms": list(cols[0]), "fwd_ms": list(cols[1]),
                         "peak_extra_MiB": list(cols[2]), "peak_MiB": list(cols[3])}}


def free(d):
    gc.collect()
    torch.cuda.empty_cache()
    d.sync()


# -- ours ------------------------------------------------------------------------------

def import_ours():
    try:
        import moeflow
        import moeflow.ep  # noqa: F401
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return moeflow, None


def run_ours(d, args, name, moeflow):
    T, H, Fd, E, K, router = CASES[name]
    x, dy, w = case_inputs(d, name, args.seed)
    # The group's buffers (NCCL symmetric memory, communicators) are outside torch's
    # allocator, so outside the peaks: their size is the device memory the group took.
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(d.dev)[0]
    reserved_before = torch.cuda.memory_reserved(d.dev)
    cap = -1
    if args.capacity_factor is not None:
        cap = -(-math.ceil(T * K * args.capacity_factor) // args.align) * args.align
    wire = dict(dtype=torch.bfloat16)
    if args.fp8_wire:  # the tokens cross as e4m3 codes with their 1x128 scales
        wire = dict(dtype=torch.float8_e4m3fn, scale_cols=-(-H // 128),
                    backward_dtype=torch.bfloat16)
    group = moeflow.ep.Group(dist.group.WORLD, num_experts=E, topk=K, hidden_size=H,
                             backend=args.backend, max_tokens_per_rank=T, align=args.align,
                             capacity_rows=cap,
                             combine_wire_dtype=getattr(torch, args.combine_wire), **wire)
    opts = dict(router)
    if opts.get("use_expert_bias"):
        # Counts only, the bias updated by the training loop (megatron's way): the
        # routing then stays that of the shared router weight in both layers.
        opts["expert_bias_update"] = "step"
    torch.manual_seed(args.seed)
    layer = moeflow.MoELayer(H, Fd, E, K, **opts,
                             load_balancing_type="aux_loss" if args.aux_loss_coeff else "none",
                             aux_loss_coeff=args.aux_loss_coeff, align=args.align,
                             params_dtype=torch.bfloat16, device=d.dev, ep_group=group,
                             precision=args.precision, fp8_wgrad=args.fp8_wgrad,
                             fp8_weight_cache=args.fp8_weight_cache)
    layer.train()
    rw = getattr(layer, "router_weight", None)
    if rw is not None and tuple(rw.shape) == (E, H):
        with torch.no_grad():
            rw.copy_(w)
    else:
        log(d, "note: moeflow's layer has no [E, H] router_weight: its own initialisation")
    del w
    res = measure(d, layer, layer.parameters(), x, dy, args.warmup, args.iters)
    prof = profile_step(d, args, f"moeflow_{name}", layer, layer.parameters(), x, dy)
    # Slots dropped for want of receive rows (none expected: worst-case capacity).
    ov = getattr(layer, "last_ep_overflow", None)
    # What moeflow holds outside torch's allocator after the steps: the group's
    # buffers and its dispatch states (the handles' pool), all of the device
    # memory taken since before the group less what torch's allocator grew by.
    torch.cuda.synchronize()
    used = free_before - torch.cuda.mem_get_info(d.dev)[0]
    buffers_mib = (used - (torch.cuda.memory_reserved(d.dev) - reserved_before)) / MiB
    res += [float(ov.sum().item()) if ov is not None else 0.0, buffers_mib]
    n_local = sum(p.numel() for p in layer.parameters())
    del layer, x, dy
    gc.collect()
    d.sync()
    destroy = getattr(group, "destroy", None)
    if destroy is not None:  # every rank together, no handle left
        destroy()
    del group
    return res, n_local, prof


# -- megatron -----------------------------------------------------------------------------

def run_megatron(d, args, name, experts):
    T, H, Fd, E, K, router = CASES[name]
    peers_megatron.setup(d.world, args.seed, args.timeout_min)
    x, dy, w = case_inputs(d, name, args.seed)
    cfg = peers_megatron.make_config(H, Fd, E, K, router, d.world, args.aux_loss_coeff,
                                     act_fusion=not args.no_peer_act_fusion, experts=experts)
    torch.manual_seed(args.seed)
    layer = peers_megatron.build_layer(cfg, experts)
    with torch.no_grad():
        peers_megatron.router_weight(layer).copy_(w)
    del w

    def fwd(t):  # megatron's layout: [S, B, H]
        out, bias = layer(t.view(T, 1, H))
        assert bias is None
        return out.view(T, H)

    res = measure(d, fwd, layer.parameters(), x, dy, args.warmup, args.iters)
    prof = profile_step(d, args, f"megatron-{experts}_{name}", fwd, layer.parameters(), x, dy)
    n_local = sum(p.numel() for p in layer.parameters())
    layer = x = dy = None  # noqa: F841 (fwd holds layer: dropped with it)
    return res, n_local, prof


# -- output ------------------------------------------------------------------------------

def fmt_mem(r):
    return f"{r['peak_extra_MiB'] / 1024:5.1f}/{r['peak_MiB'] / 1024:5.1f}"


def table(rows, world):
    """The text table: per case, ours against each peer variant."""
    head = (f"{'case':11s} {'W':>2s} {'ours step':>9s} {'fwd':>7s} {'peer':10s} "
            f"{'mcore step':>10s} {'fwd':>7s} {'mcore/ours':>10s}  "
            f"{'peak GiB (extra/abs) ours':>25s} {'mcore':>11s}")
    lines = [head, "-" * len(head)]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    for case, rs in by_case.items():
        ours = next((r for r in rs if r["impl"] == "moeflow"), None)
        peers = [r for r in rs if r["impl"] != "moeflow"] or [None]
        for p in peers:
            o_s = f"{ours['step_ms']:9.2f} {ours['fwd_ms']:7.2f}" if ours and "step_ms" in ours \
                else f"{'-':>9s} {'-':>7s}"
            o_m = fmt_mem(ours) if ours and "step_ms" in ours else "-"
            if p is None:
                lines.append(f"{case:11s} {world:2d} {o_s} {'-':10s} {'-':>10s} {'-':>7s} "
                             f"{'-':>10s}  {o_m:>25s} {'-':>11s}")
                continue
            label = p["impl"].split("-", 1)[1]
            if "step_ms" not in p:
                lines.append(f"{case:11s} {world:2d} {o_s} {label:10s} "
                             f"{'failed: ' + p.get('error', '?')[:60]}")
                continue
            ratio = f"{p['step_ms'] / ours['step_ms']:10.2f}" if ours and "step_ms" in ours \
                else f"{'-':>10s}"
            lines.append(f"{case:11s} {world:2d} {o_s} {label:10s} {p['step_ms']:10.2f} "
                         f"{p['fwd_ms']:7.2f} {ratio}  {o_m:>25s} {fmt_mem(p):>11s}")
    b2b = []
    for case, rs in by_case.items():
        ours = next((r for r in rs if r["impl"] == "moeflow" and "back_to_back_ms" in r), None)
        for p in rs:
            if p["impl"] != "moeflow" and "back_to_back_ms" in p and ours:
                b2b.append(f"{case} {ours['back_to_back_ms']:.2f} / {p['back_to_back_ms']:.2f} "
                           f"({p['back_to_back_ms'] / ours['back_to_back_ms']:.2f}x)")
    if b2b:
        lines.append("steps back to back (no barrier between them), ms, ours / mcore: "
                     + ", ".join(b2b))
    groups = [f"{r['case']} {r['ep_buffers_MiB'] / 1024:.2f}" for r in rows
              if r["impl"] == "moeflow" and "ep_buffers_MiB" in r]
    dropped = [f"{r['case']} {r['ep_overflow']:.0f}" for r in rows
               if r["impl"] == "moeflow" and r.get("ep_overflow")]
    if dropped:
        lines.append("moeflow slots dropped for want of receive capacity (the rows differ "
                     "from the peer's): " + ", ".join(dropped))
    if groups:
        lines.append("moeflow memory outside torch's allocator (EP group + dispatch states; "
                     "add to its peaks), GiB: " + ", ".join(groups))
    return "\n".join(lines)


def write_json(d, args, meta, rows):
    if d.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


def main():
    args = parse_args()
    d = Dist(args.timeout_min)
    for name in args.cases:
        E = CASES[name][3]
        if E % d.world:
            sys.exit(f"py_layer_ep: case {name}: {E} experts do not split over {d.world} ranks")
    meta = {"device": torch.cuda.get_device_name(d.dev), "world": d.world,
            "torch": torch.__version__, "backend": args.backend, "combine_wire": args.combine_wire,
            "precision": args.precision, "fp8_wire": args.fp8_wire, "fp8_wgrad": args.fp8_wgrad,
            "fp8_weight_cache": args.fp8_weight_cache,
            "capacity_factor": args.capacity_factor, "warmup": args.warmup,
            "iters": args.iters, "aux_loss_coeff": args.aux_loss_coeff,
            "timing": "median per rank over the timed steps, then the slowest rank; "
                      "peaks: the largest over the ranks (MiB)"}
    rows = []

    # Ours first, over every case: its failure ends the run (non-zero exit).
    if args.impl in ("both", "ours"):
        moeflow, err = import_ours()
        if moeflow is None:
            if d.rank == 0:
                print(f"py_layer_ep: moeflow (with moeflow.ep) is not importable: {err}\n"
                      f"  build it and put its Python package on PYTHONPATH "
                      f"(e.g. PYTHONPATH=build/python)", file=sys.stderr, flush=True)
            os._exit(1)
        meta["moeflow"] = getattr(moeflow, "__version__", "?")
        for name in args.cases:
            log(d, f"case {name} W={d.world}: moeflow (backend {args.backend}): "
                   f"{args.warmup} warm-up + {args.iters} timed steps")
            try:
                res, n, prof = run_ours(d, args, name, moeflow)
            except Exception:
                print(f"py_layer_ep: rank {d.rank}: moeflow failed on case {name}:\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
                os._exit(1)  # torchrun then stops the other ranks
            per_rank = d.gather(res)
            r = dict(case=name, W=d.world, impl="moeflow", backend=args.backend,
                     tokens_per_rank=CASES[name][0], **summarise([v[:5] for v in per_rank]))
            r["ep_overflow"] = max(v[5] for v in per_rank)
            r["ep_buffers_MiB"] = max(v[6] for v in per_rank)
            r["capacity_factor"] = args.capacity_factor
            r["params_per_rank"] = n
            if prof is not None:
                r["profile_rank0"] = prof
            rows.append(r)
            write_json(d, args, meta, rows)
            log(d, f"  moeflow: step {r['step_ms']:.2f} ms, fwd {r['fwd_ms']:.2f} ms, "
                   f"back to back {r['back_to_back_ms']:.2f} ms, "
                   f"peak {fmt_mem(r)} GiB (extra/abs), outside torch "
                   f"{r['ep_buffers_MiB'] / 1024:.2f} GiB"
                   + (f"; {r['ep_overflow']:.0f} slots dropped (receive capacity)"
                      if r["ep_overflow"] else ""))
            free(d)

    # The peer: a failure is reported and the run goes on.
    if args.impl in ("both", "megatron"):
        version, err = peers_megatron.import_megatron(args.mcore_path)
        variants = peers_megatron.EXPERTS if args.peer_experts == "both" \
            else (args.peer_experts,)
        if version is None:
            msg = (f"megatron-core is not importable ({err}); install it with\n"
                   f"  python3 -m pip install --no-deps --no-index --target /tmp/mcore "
                   f".wheels/megatron_core-0.19.2-*.whl\n"
                   f"and pass --mcore-path /tmp/mcore (or PYTHONPATH=/tmp/mcore)")
            if d.rank == 0:
                print(f"py_layer_ep: {msg}", file=sys.stderr, flush=True)
            meta["megatron"] = None
            meta["megatron_error"] = err
        else:
            meta["megatron"] = version
            meta["megatron_experts"] = {v: peers_megatron.EXPERTS_DESC[v] for v in variants}
            meta["megatron_act_fusion"] = not args.no_peer_act_fusion
            for name in args.cases:
                for v in variants:
                    log(d, f"case {name} W={d.world}: megatron-core {version} ({v} experts)")
                    err, res, n, prof = None, None, 0, None
                    try:
                        res, n, prof = run_megatron(d, args, name, v)
                    except Exception as e:
                        err = f"{type(e).__name__}: {e}"
                        print(f"py_layer_ep: rank {d.rank}: megatron ({v}) failed on case "
                              f"{name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                    r = dict(case=name, W=d.world, impl=f"megatron-{v}",
                             tokens_per_rank=CASES[name][0])
                    if d.any(err is not None):
                        r["error"] = err or "failed on another rank"
                    else:
                        r.update(summarise(d.gather(res)))
                        r["params_per_rank"] = n
                        if prof is not None:
                            r["profile_rank0"] = prof
                        log(d, f"  megatron ({v}): step {r['step_ms']:.2f} ms, fwd "
                               f"{r['fwd_ms']:.2f} ms, back to back "
                               f"{r['back_to_back_ms']:.2f} ms, peak {fmt_mem(r)} GiB "
                               f"(extra/abs)")
                    rows.append(r)
                    write_json(d, args, meta, rows)
                    free(d)

    if d.rank == 0:
        print(f"\nEP MoE layer step (fwd+bwd, router included), {d.world} x "
              f"{meta['device']}, moeflow backend {args.backend}, receive capacity "
              f"{'the worst case' if args.capacity_factor is None else 'T*K*%g' % args.capacity_factor}"
              f"; ms = the slowest rank's "
              f"median; peak GiB = the largest rank's (extra over params+inputs / absolute)")
        if meta.get("megatron_experts"):
            for v, desc in meta["megatron_experts"].items():
                print(f"  megatron {v}: {desc}")
        print(table(rows, d.world), flush=True)
    write_json(d, args, meta, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
