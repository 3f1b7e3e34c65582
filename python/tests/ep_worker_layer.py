"""The expert-parallel MoELayer's checks for ep_worker.py (run by
test_ep.py): the EP layer against the single-device one on all the tokens,
its grouped-MLP node (dispatch, MLP, combine in one autograd node) against
the chained ops bit for bit, and the same layer in FP8 (with FP8 on the
wire: what its forward keeps for backward)."""
import os
import tempfile

import torch
import torch.distributed as dist

import moeflow.ep as ep
from moeflow import _C, ops
from moeflow.layer import MoELayer

from ep_worker import eq, make_inputs, raises, rel_err, tokens


def check_layer(ctx, H=32, F=16, precision="bf16", tol=2e-2, wire8=False, fp8_wgrad=False):
    """The EP MoELayer against the same layer without ep_group on all the
    tokens in one process (same router weight, the gathered experts).
    wire8: an FP8 group (the tokens cross as their 1x128 e4m3 codes)."""
    W, r, dev = ctx.world, ctx.rank, ctx.device
    E, K, dt = 2 * W, 2, torch.bfloat16
    T_list = tokens(W, 9, 0, 5)
    align = 128 if fp8_wgrad else 16
    lkw = dict(params_dtype=dt, precision=precision, fp8_wgrad=fp8_wgrad)
    torch.manual_seed(0)
    full = MoELayer(H, F, E, K, device="cpu", align=align, **lkw)
    gkw = dict(dtype=torch.float8_e4m3fn, scale_cols=-(-H // 128), backward_dtype=dt) \
        if wire8 else dict(dtype=dt)
    g = ctx.group(num_experts=E, topk=K, hidden_size=H, max_tokens_per_rank=max(T_list),
                  align=align, **gkw)
    layer = MoELayer(H, F, E, K, device=dev, ep_group=g, **lkw)
    first, last = g.expert_range
    if tuple(layer.fc1_weight.shape) != (g.local_experts, 2 * F, H):
        raise AssertionError(f"fc1_weight {tuple(layer.fc1_weight.shape)}")
    layer.load_state_dict(full.state_dict())  # a whole checkpoint: the local slice
    eq("loaded fc1", layer.fc1_weight, full.fc1_weight.detach()[first:last])
    inputs = make_inputs(T_list, E, K, H, dt, "random", 10)
    X = torch.cat([i["x"] for i in inputs]).float().requires_grad_()
    D = torch.cat([i["dout"] for i in inputs]).float()
    ref = full(X)
    ref.backward(D)
    x = inputs[r]["x"].float().to(dev).requires_grad_()
    out = layer(x)
    out.backward(inputs[r]["dout"].float().to(dev))
    s, e = sum(T_list[:r]), sum(T_list[:r + 1])
    router_grad = layer.router_weight.grad
    router_grad = torch.zeros_like(layer.router_weight) if router_grad is None else \
        router_grad.clone()
    dist.all_reduce(router_grad)  # the router's gradient: summed over the ranks' tokens
    checks = [("out", out, ref[s:e]), ("x.grad", x.grad, X.grad[s:e]),
              ("router_weight.grad", router_grad, full.router_weight.grad),
              ("fc1_weight.grad", layer.fc1_weight.grad, full.fc1_weight.grad[first:last]),
              ("fc2_weight.grad", layer.fc2_weight.grad, full.fc2_weight.grad[first:last])]
    for name, got, want in checks:
        if want.numel() and (not torch.isfinite(got.float()).all() or rel_err(got, want) > tol):
            raise AssertionError(f"EP layer {name}: relative error {rel_err(got, want):.3g}")
    eq("last_ep_overflow", layer.last_ep_overflow.cpu(), torch.zeros(1, dtype=torch.int32))
    # Checkpoints: the local experts under their global ids.
    layer.state_dict_layout = "per_expert"
    sd = layer.state_dict()
    want_keys = {f"fc1_weight{i}" for i in range(first, last)}
    got_keys = {k for k in sd if k.startswith("fc1_weight")}
    if got_keys != want_keys:
        raise AssertionError(f"per-expert keys {sorted(got_keys)}, want {sorted(want_keys)}")
    full.state_dict_layout = "per_expert"
    fresh = MoELayer(H, F, E, K, device=dev, ep_group=g, **lkw)
    fresh.load_state_dict(full.state_dict())  # all E per-expert keys: the local ones kept
    eq("per-expert load", fresh.fc2_weight, full.fc2_weight.detach()[first:last])
    fresh.load_state_dict(sd)  # this rank's own per-expert state dict
    eq("own per-expert load", fresh.fc1_weight, layer.fc1_weight.detach().cpu())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.safetensors")
        full.save_safetensors(path, layout="per_expert")
        fresh2 = MoELayer(H, F, E, K, device=dev, ep_group=g, **lkw)
        fresh2.load_safetensors(path)  # a whole file: the local experts kept
        eq("load_safetensors fc1", fresh2.fc1_weight, full.fc1_weight.detach()[first:last])
        eq("load_safetensors router", fresh2.router_weight, full.router_weight.detach())
        if W > 1:  # (one rank holds every expert)
            raises(_C.Error, r"save_safetensors: the layer holds experts",
                   lambda: fresh2.save_safetensors(os.path.join(tmp, "local.safetensors")))


def check_mlp_node_is_the_chained_ops(ctx, H=32, F=16):
    """grouped_mlp's expert-parallel node (dispatch, MLP, combine in one
    autograd node, as MoELayer runs them) against dispatch -> grouped_mlp ->
    combine chained: output and every gradient bit for bit."""
    W, r, dev = ctx.world, ctx.rank, ctx.device
    E, K, dt = 2 * W, 2, torch.bfloat16
    T_list = tokens(W, 9, 0, 5)
    g = ctx.group(num_experts=E, topk=K, hidden_size=H, dtype=dt,
                  max_tokens_per_rank=max(T_list))
    mine = make_inputs(T_list, E, K, H, dt, "random", 12)[r]
    gen = torch.Generator().manual_seed(13 + r)
    w0 = [(torch.randn(*sh, generator=gen) * 0.2).to(dt).to(dev)
          for sh in ((g.local_experts, 2 * F, H), (g.local_experts, H, F))]
    grads = []
    for fused in (True, False):
        x = mine["x"].to(dev).clone().requires_grad_()
        p = mine["probs"].to(dev).clone().requires_grad_()
        w1, w2 = (w.clone().requires_grad_() for w in w0)
        ids = mine["ids"].to(dev)
        if fused:
            xin, args = ep._prepare_dispatch(x, ids, p, g, None)
            out = ops.grouped_mlp(xin, w1, w2, probs=p, _ep=args)
        else:
            rows, tpe, offs, h = ep.dispatch(x, ids, p, g)
            out = ep.combine(ops.grouped_mlp(rows, w1, w2, offsets=offs, real_rows=tpe), h, p)
        out.backward(mine["dout"].to(dev))
        grads.append([out, x.grad, p.grad, w1.grad, w2.grad])
    for name, a, b in zip(("out", "x.grad", "probs.grad", "fc1.grad", "fc2.grad"), *grads):
        eq(f"node vs chained: {name}", a, b.detach().cpu())


def check_layer_fp8(ctx):
    # precision="fp8-blockwise": a row's codes and an expert's weight blocks
    # do not depend on where they are, but the one-process layer weights FC2's
    # input by the probs (a * p quantized) and the EP layer weights FC2's
    # output in combine (a quantized): about 6 % of the codes round the other
    # way. Hence the FP8 bound of test_mlp_fp8.py (0.1), not bf16's.
    check_layer(ctx, H=128, F=128, precision="fp8-blockwise", tol=0.1)


def check_layer_fp8_wire(ctx):
    # An FP8 group: the tokens cross as their 1x128 codes, which are FC1's
    # input; FC1's 16-bit weight gradient reads them dequantized, its FP8 one
    # their columnwise codes from the dequantized rows (the one-process
    # layer: from the tokens). The same FP8 bound.
    check_layer(ctx, H=128, F=128, precision="fp8-blockwise", tol=0.1, wire8=True)
    check_layer(ctx, H=128, F=128, precision="fp8-blockwise", tol=0.1, wire8=True,
                fp8_wgrad=True)
    g = ctx.group(num_experts=2 * ctx.world, topk=2, hidden_size=128, max_tokens_per_rank=4,
                  dtype=torch.float8_e4m3fn, scale_cols=1)
    raises(ValueError, r"an FP8 ep_group \(FP8 on the wire\) needs precision='fp8-blockwise'",
           lambda: MoELayer(128, 128, 2 * ctx.world, 2, ep_group=g, device=ctx.device))


def check_fp8_wire_keeps_codes(ctx, H=128, F=128):
    """With FP8 on the wire and a 16-bit FC1 weight gradient, what the
    layer's forward saves for backward holds the received rows as their
    codes (which the dispatch's handle holds anyway), not dequantized as 16-bit rows:
    every saved tensor of the rows' shape [capacity, H] is FP8, but for y
    (FC2's output, which the combine's backward reads)."""
    W, r, dev = ctx.world, ctx.rank, ctx.device
    E, K, dt = 2 * W, 2, torch.bfloat16
    T_list = tokens(W, 9, 0, 5)
    g = ctx.group(num_experts=E, topk=K, hidden_size=H, max_tokens_per_rank=max(T_list),
                  dtype=torch.float8_e4m3fn, scale_cols=1, backward_dtype=dt)
    layer = MoELayer(H, F, E, K, device=dev, ep_group=g, params_dtype=dt,
                     precision="fp8-blockwise")
    x = make_inputs(T_list, E, K, H, dt, "random", 14)[r]["x"].float().to(dev)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    rows = [t for t in saved if t.dim() == 2 and tuple(t.shape) == (g.capacity_rows, H)]
    fp8 = [t for t in rows if t.dtype == torch.float8_e4m3fn]
    wide = [t for t in rows if t.dtype != torch.float8_e4m3fn]
    if len(fp8) != 1 or len(wide) > 1:
        raise AssertionError(f"saved [capacity, H] tensors: {[t.dtype for t in rows]}, want "
                             f"the codes and at most y")
    out.backward(torch.ones_like(out))
    if not torch.isfinite(layer.fc1_weight.grad.float()).all():
        raise AssertionError("fc1_weight.grad is not finite")


CHECKS = {f.__name__[len("check_"):]: f for f in (
    check_layer, check_mlp_node_is_the_chained_ops, check_layer_fp8, check_layer_fp8_wire,
    check_fp8_wire_keeps_codes)}
