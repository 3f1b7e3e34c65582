"""Host cost of moeflow.ops calls over the C++ calls they make: each op is
called many times on tiny CUDA tensors (so that the GPU is never what
waits), once through moeflow.ops (autograd function, output allocation,
argument checks) and once straight through moeflow._C with outputs
allocated beforehand. Reports microseconds per call and the difference.
Where moeflow.ops has a node in C++ (moeflow._autograd: Plan, permute,
unpermute), a second row times its Python node ("(Python node)").

    PYTHONPATH=build/python:bench python3 bench/py_overhead.py [--json FILE]
"""
import argparse
import json
import time

import torch

import moeflow.ops as mf
from moeflow import _C


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    s = torch.cuda.current_stream().cuda_stream
    T, H, F, E, K = 64, 128, 64, 8, 2
    logits = torch.randn(T, E, device=dev)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    fc1 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.1
    fc2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * 0.1
    with torch.no_grad():
        r = mf.router(logits, K)
    plan = mf.Plan(r.topk_ids, E, 16)
    rows, row_probs = mf.permute(x, plan, r.probs)
    y = mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=row_probs)

    # Outputs for the direct _C calls.
    cfg = (E, K, "softmax", False, 0, 0, 1.0, 0.0, 0.0, 0.0)
    ids = torch.empty(T, K, dtype=torch.int32, device=dev)
    probs = torch.empty(T, K, device=dev)
    tpe = torch.empty(E, dtype=torch.int32, device=dev)
    nonfinite = torch.empty(1, dtype=torch.int32, device=dev)
    ws = torch.empty(max(1, _C.router_workspace_bytes(T, *cfg)), dtype=torch.uint8, device=dev)
    rows_c, pp_c = torch.empty_like(rows), torch.empty_like(row_probs)
    h = torch.empty(rows.shape[0], 2 * F, device=dev, dtype=torch.bfloat16)
    a = torch.empty(rows.shape[0], F, device=dev, dtype=torch.bfloat16)
    y_c, out_c = torch.empty_like(y), torch.empty_like(x)
    offs, real = plan.expert_row_offsets, plan.tokens_per_expert
    view = plan._view
    ld, xd, w1d, w2d = (t.detach() for t in (logits, x, fc1, fc2))  # for the _C calls

    cases = [
        ("router", lambda: mf.router(logits, K),
         lambda: _C.router_forward(ld, *cfg, ids, probs, tpe, None, None, None, None, nonfinite,
                                   None, None, None, None, ws, s)),
        ("Plan", lambda: mf.Plan(r.topk_ids, E, 16),
         lambda: _C.build_plan(r.topk_ids, view, plan._workspace, s)),
        ("permute", lambda: mf.permute(x, plan, r.probs),
         lambda: _C.permute(xd, view, rows_c, r.probs, pp_c, None, None, s)),
        ("grouped_mlp", lambda: mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=row_probs),
         lambda: _C.grouped_mlp_forward(rows, w1d, w2d, None, None, offs, real, row_probs,
                                        "swiglu", 0, 1.702, 7.0, 1.0, y_c, h, a, s)),
        ("unpermute", lambda: mf.unpermute(y, plan),
         lambda: _C.unpermute(y, view, out_c, None, s)),
    ]
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ops": {}}
    # The moeflow.ops calls record their autograd nodes (inputs require grad),
    # as in training.
    for t in (logits, x, fc1, fc2):
        t.requires_grad_(True)
    # y above needs no gradient (made before requires_grad_): unpermute's
    # autograd path is timed on a y that does; and the router under no_grad.
    y_g = mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=row_probs)
    cases += [
        ("unpermute_grad", lambda: mf.unpermute(y_g, plan), cases[4][2]),
        ("router_nograd", lambda: mf.router(logits, K), cases[0][2]),
    ]
    if mf._nodes is not None:
        nodes = mf._nodes

        def py_plan():
            mf._nodes = None
            try:
                return mf.Plan(r.topk_ids, E, 16)
            finally:
                mf._nodes = nodes

        cases += [
            ("Plan (Python node)", py_plan, cases[1][2]),
            ("permute (Python node)", lambda: mf._Permute.apply(x, r.probs, plan, None),
             cases[2][2]),
            ("unpermute_grad (Python node)", lambda: mf._Unpermute.apply(y_g, None, plan),
             cases[4][2]),
        ]
    out["cpp_nodes"] = mf._nodes is not None
    for name, py, c in cases:
        with torch.set_grad_enabled(name != "router_nograd"):
            tp, tc = per_call_us(py), per_call_us(c)
        out["ops"][name] = {"python_us": tp, "cpp_us": tc, "overhead_us": tp - tc}
        print(f"{name:28s} moeflow.ops {tp:6.1f} us/call, _C {tc:6.1f} us/call, "
              f"overhead {tp - tc:5.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
