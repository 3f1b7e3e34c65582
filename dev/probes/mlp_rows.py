"""What sets the grouped MLP's speed inside the layer? Times
moeflow.ops.grouped_mlp forward + backward (bf16 weight gradients) on the
layer rows of bench/py_layer.py's dsv3 case (T 8192, top-8 of 32 experts,
H 7168, F 2048) and mixtral case (T 16384, top-2 of 8, H 4096, F 14336) in
turn, same process, varying one thing at a time:

  uniform, constant   2048 rows per expert, every operand one constant value
  uniform, randn      2048 rows per expert, randn operands
  router, real_rows   the rows a softmax router (random weights) gives, each
                      expert padded to 16 rows, with the plan's real rows
                      (as the layer runs it)
  router, offsets     the same padded offsets without real_rows
  router, align 128   the same routing padded to 128 rows
  uniform, router x   uniform groups holding the router case's rows (each
                      token's row K times)
  router, randn x     the router case's groups holding unique randn rows

Each variant's grouped GEMMs are also profiled once (TFLOP/s per kind, as
bench/py_layer.py --profile prints them).

    PYTHONPATH=build/python:bench python3 dev/probes/mlp_rows.py [--case dsv3|mixtral]
"""
import argparse

import torch

import moeflow.ops as mf
from py_layer import gemm_rates, kernel_sum_ms


CASES = {"dsv3": (8192, 8, 32, 7168, 2048), "mixtral": (16384, 2, 8, 4096, 14336)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    for name in ap.parse_args().case or ["dsv3", "mixtral"]:
        print(f"== {name}", flush=True)
        run(*CASES[name])
        torch.cuda.empty_cache()


def run(T, K, E, H, F):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows_u = T * K
    w1 = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    x_tok = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    router_w = torch.randn(E, H, device=dev, generator=g) * 0.02
    ids = torch.topk(x_tok.float() @ router_w.t(), K, dim=1).indices.to(torch.int32)
    plans = {a: mf.Plan(ids, E, a) for a in (16, 128)}
    variants = {}
    offs_u = torch.arange(E + 1, device=dev, dtype=torch.int64) * (rows_u // E)
    xu = torch.randn(rows_u, H, device=dev, generator=g).to(torch.bfloat16)
    c = lambda *s: torch.full(s, 0.0115, device=dev, dtype=torch.bfloat16)  # noqa: E731
    variants["uniform, constant"] = (c(rows_u, H), c(E, 2 * F, H), c(E, H, F), offs_u, None)
    variants["uniform, randn"] = (xu, w1, w2, offs_u, None)
    for a, plan in plans.items():
        x = mf.permute(x_tok, plan)[0]
        if a == 16:
            variants["router, real_rows"] = (x, w1, w2, plan.expert_row_offsets,
                                             plan.tokens_per_expert)
            # one thing of the router case at a time: its rows' values on
            # uniform groups, and unique randn rows on its groups
            variants["uniform, router x"] = (x[:rows_u].contiguous(), w1, w2, offs_u, None)
            xr = torch.randn(x.shape, device=dev, generator=g).to(torch.bfloat16)
            variants["router, randn x"] = (xr, w1, w2, plan.expert_row_offsets,
                                           plan.tokens_per_expert)
            variants["router, offsets"] = (x, w1, w2, plan.expert_row_offsets, None)
        else:
            variants["router, align 128"] = (x, w1, w2, plan.expert_row_offsets,
                                             plan.tokens_per_expert)
    counts = plans[16].tokens_per_expert.tolist()
    print(f"router rows per expert: min {min(counts)} max {max(counts)} "
          f"(uniform {rows_u // E})", flush=True)
    state = {}
    for name, (x, a, b, offs, real) in variants.items():
        state[name] = (x.clone().requires_grad_(True), a.clone().requires_grad_(True),
                       b.clone().requires_grad_(True), offs, real,
                       torch.randn(x.shape[0], H, device=dev, generator=g).to(torch.bfloat16),
                       torch.rand(x.shape[0], device=dev, generator=g))

    def step(name):
        x, a, b, offs, real, dy, p = state[name]
        for t in (x, a, b):
            t.grad = None
        mf.grouped_mlp(x, a, b, offsets=offs, real_rows=real, probs=p).backward(dy)

    # Steady state: the GPU's clock follows its power draw over the last tens
    # of milliseconds, so a variant timed right after a low-power one (the
    # constant operands) looks faster. Each variant runs 8 steps untimed,
    # then 8 timed back to back; uniform randn runs first and last (drift).
    flops = 3 * 2 * rows_u * H * 3 * F  # the routed rows' work (T * K rows)
    order = [n for n in state if n != "uniform, constant"] + ["uniform, randn",
                                                               "uniform, constant"]
    for name in order:
        for _ in range(8):
            step(name)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(8):
            step(name)
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e) / 8
        for _ in range(3):
            step(name)
        total, by_name = kernel_sum_ms(lambda: step(name))
        rates = gemm_rates(by_name, rows_u, H, F)
        print(f"{name:20s} rows {state[name][0].shape[0]:6d}  step {ms:7.2f} ms "
              f"({flops / ms / 1e9:5.1f} TFLOP/s of T*K rows); kernels {total:6.2f} ms; GEMMs: " +
              ", ".join(f"{k} {v:.0f}" for k, v in rates.items()), flush=True)


if __name__ == "__main__":
    main()
