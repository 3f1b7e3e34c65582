"""FP8 dispatch checks of moeflow.ep, run by test_ep.py through ep_worker.run.

An FP8 group (dtype float8_e4m3fn / float8_e5m2) moves FP8 rows with their
per-token scales: every rank's rows and scales must arrive bit for bit in the
receive layout of moeflow/ep_reference.h. The oracle is the one of float
tokens (ep_worker.Oracle: one ops.Plan per expert rank over the gathered
tokens), with ops.permute of the gathered FP8 rows and their scales (FP8
rows carry scales there too); rows are compared as bytes. Combine and its
backward run on bfloat16 expert outputs, as for a bfloat16 group.
"""
import torch

import moeflow.ep as ep
from moeflow import ops

from ep_worker import Oracle, close, eq, expert_outputs, make_inputs, raises, tokens

BF16 = torch.bfloat16


def fp8_inputs(T_list, E, K, H, dtype, scale_cols, scale_dtype, seed):
    """Per rank (ep_worker.make_inputs, bfloat16) plus q [T, H] of the FP8
    dtype and s [T, scale_cols]: ops.quantize's 1x128 rows and scales when
    the scales are its float32 ones, else random bytes (NaN and infinity
    codes included: they must travel as bytes)."""
    inputs = make_inputs(T_list, E, K, H, BF16, "random", seed)
    fmt = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
    quantized = scale_dtype == torch.float32 and scale_cols == -(-H // 128)
    for r, inp in enumerate(inputs):
        T = inp["x"].shape[0]
        if quantized:
            inp["q"], inp["s"] = ops.quantize(inp["x"], fmt, "1x128")
        else:
            g = torch.Generator().manual_seed(4241 * seed + r)
            inp["q"] = torch.randint(0, 256, (T, H), generator=g, dtype=torch.uint8).view(dtype)
            esz = torch.empty((), dtype=scale_dtype).element_size()
            inp["s"] = torch.randint(0, 256, (T, scale_cols * esz), generator=g,
                                     dtype=torch.uint8).view(scale_dtype)
    return inputs


def as_bytes(t, total):
    """The first `total` rows of t as uint8 [total, bytes per row] (CPU)."""
    t = t[:total].detach().cpu().contiguous()
    return t.reshape(t.shape[0], t.shape[1:].numel()).view(torch.uint8)


class _QuantizedDispatch(torch.autograd.Function):
    """The recipe of docs/python.md: quantize, dispatch the FP8 rows with
    their scales, hand the experts the dequantized rows; backward: the rows'
    gradient summed home (combine without probs). The handle goes to
    `box` (the caller's combine takes it)."""

    @staticmethod
    def forward(ctx, x, ids, probs, group, box):
        q, s = ops.quantize(x, "e4m3", "1x128")
        rows, _, _, h = ep.dispatch(q, ids, probs, group, scales=s)
        ctx.handle = h
        box.append(h)
        return ops.dequantize(rows, h.row_scales, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_rows):
        h = ctx.handle
        dx = ep.combine(grad_rows.to(h.group.backward_dtype).contiguous(), h)
        return dx, None, None, None, None


def run_fp8(ctx, T_list, E, K, H, dtype, scale_cols, scale_dtype, seed, align=16,
            capacity_rows=-1):
    """One FP8 dispatch -> bf16 combine (weighted) with backward, and the
    dispatch's gradient path (combine of grad_rows without probs), against
    the oracle. Returns the oracle (for the caller's own checks)."""
    W, r, dev = ctx.world, ctx.rank, ctx.device
    g = ctx.group(num_experts=E, topk=K, hidden_size=H, dtype=dtype, scale_cols=scale_cols,
                  scale_dtype=scale_dtype, backward_dtype=BF16,
                  max_tokens_per_rank=max(T_list + [1]), align=align, capacity_rows=capacity_rows)
    cap = g.capacity_rows
    inputs = fp8_inputs(T_list, E, K, H, dtype, scale_cols, scale_dtype, seed)
    o = Oracle(inputs, E, align, cap)  # plans (and bf16 combine) of the gathered tokens
    Q = torch.cat([i["q"] for i in inputs])
    S = torch.cat([i["s"] for i in inputs])
    ys, gs = expert_outputs(W, cap, H, BF16, seed)
    mine = inputs[r]
    q, s = mine["q"].to(dev), mine["s"].to(dev)
    ids = mine["ids"].to(dev)
    p = mine["probs"].to(dev).clone().requires_grad_()
    rows, tpe, offs, h = ep.dispatch(q, ids, p, g, scales=s)
    plan = o.plans[r]
    total = int(plan.total_rows)
    if rows.dtype != dtype or tuple(rows.shape) != (cap, H):
        raise AssertionError(f"rows: {rows.dtype} {list(rows.shape)}")
    sc = h.row_scales
    if sc is None or sc.dtype != scale_dtype or tuple(sc.shape) != (cap, scale_cols):
        raise AssertionError(f"row_scales: {None if sc is None else (sc.dtype, list(sc.shape))}")
    if rows.requires_grad or sc.requires_grad:
        raise AssertionError("FP8 rows or their scales require grad")
    eq("tokens_per_expert", tpe, plan.tokens_per_expert)
    eq("expert_row_offsets", offs, plan.expert_row_offsets)
    eq("total_rows", h.total_rows, plan.total_rows)
    eq("overflow", h.overflow, plan.overflow)
    want_rows, _, want_scales = ops.permute(Q, plan, None, S)
    eq("rows (bytes)", as_bytes(rows, total), as_bytes(want_rows, total))
    eq("row_scales (bytes)", as_bytes(sc, total), as_bytes(want_scales, total))
    eq("row_probs", h.row_probs[:total], o.row_probs[r][:total])
    # combine of bf16 expert outputs, weighted, and its backward
    y = ys[r].to(dev).clone().requires_grad_()
    out = ep.combine(y, h, p)
    out.backward(mine["dout"].to(dev))
    eq("combine (weighted)", out, o.mine(o.combine(ys, True, BF16), r))
    eq("combine backward grad_y", y.grad[:total], o.grad_y(r, True, BF16)[:total])
    close("combine backward dprobs", p.grad, o.mine(o.dprobs(ys), r))
    # the dispatch's gradient: the rows' gradient summed home
    eq("combine(grad_rows, handle)", ep.combine(gs[r].to(dev), h),
       o.mine(o.combine(gs, False, BF16), r))
    return o, rows, h


def check_fp8_e4m3_quantized_rows(ctx):
    """ops.quantize's e4m3 rows and float32 1x128 scales (one row of scales
    per token: the dispatch's layout); uneven T, a rank with none; the
    received rows dequantize to the permuted dequantized tokens."""
    W, H = ctx.world, 256
    T_list = tokens(W, 13, 0, 7)
    o, rows, h = run_fp8(ctx, T_list, E=2 * W, K=3, H=H, dtype=torch.float8_e4m3fn,
                         scale_cols=2, scale_dtype=torch.float32, seed=20)
    inputs = fp8_inputs(T_list, 2 * W, 3, H, torch.float8_e4m3fn, 2, torch.float32, 20)
    deq = torch.cat([ops.dequantize(i["q"], i["s"]) for i in inputs])
    plan = o.plans[ctx.rank]
    total = int(plan.total_rows)
    want, _ = ops.permute(deq, plan)
    eq("dequantize(rows, row_scales)", ops.dequantize(rows[:total], h.row_scales[:total]),
       want[:total])


def check_fp8_e5m2_byte_scales_dropped(ctx):
    """e5m2 rows of random bytes (NaN codes too) with 5 uint8 scales per
    token, a capacity that drops slots (their scales dropped with them)."""
    W = ctx.world
    o, _, _ = run_fp8(ctx, tokens(W, 24, 20, 17), E=3 * W, K=2, H=96, dtype=torch.float8_e5m2,
                      scale_cols=5, scale_dtype=torch.uint8, seed=21, capacity_rows=32)
    if sum(int(p.overflow) for p in o.plans) == 0:
        raise AssertionError("the small capacity dropped nothing: the check checks nothing")


def check_fp8_gradient_recipe(ctx):
    """Quantize + FP8 dispatch in an autograd function whose backward is
    combine(grad_rows, handle), experts y = 2 * rows: the tokens' gradient
    is bitwise that of the bfloat16 dispatch (autograd's dispatch backward)
    of the same routing, since grad_rows = 2 * w * dout does not depend on
    the rows' values."""
    W, dev, H = ctx.world, ctx.device, 128
    T_list = tokens(W, 9, 5, 0)
    inp = make_inputs(T_list, 2 * W, 2, H, BF16, "random", 22)[ctx.rank]
    g8 = ctx.group(num_experts=2 * W, topk=2, hidden_size=H, dtype=torch.float8_e4m3fn,
                   scale_cols=1, max_tokens_per_rank=max(T_list))
    g16 = ctx.group(num_experts=2 * W, topk=2, hidden_size=H, dtype=BF16,
                    max_tokens_per_rank=max(T_list))
    ids = inp["ids"].to(dev)
    grads = []
    for fp8 in (True, False):
        x = inp["x"].to(dev).clone().requires_grad_()
        p = inp["probs"].to(dev).clone().requires_grad_()
        if fp8:
            box = []
            rows = _QuantizedDispatch.apply(x, ids, p, g8, box)
            h = box[0]
        else:
            rows, _, _, h = ep.dispatch(x, ids, p, g16)
        ep.combine(rows * 2, h, p).backward(inp["dout"].to(dev))
        if p.grad is None or not torch.isfinite(p.grad).all():
            raise AssertionError(f"{'FP8' if fp8 else 'bf16'} path: probs.grad {p.grad}")
        grads.append(x.grad)
    eq("FP8 path x.grad == bf16 path x.grad", grads[0], grads[1].cpu())
    if grads[1].numel() and float(grads[1].float().abs().sum()) == 0:
        raise AssertionError("x.grad is zero: the check checks nothing")


def check_fp8_errors(ctx):
    W, dev = ctx.world, ctx.device
    kw = dict(num_experts=2 * W, topk=2, hidden_size=16, max_tokens_per_rank=4)
    mk = ctx.group
    f8 = torch.float8_e4m3fn
    raises(ValueError, r"backward_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
           r"got torch.int32", lambda: mk(**kw, dtype=f8, backward_dtype=torch.int32))
    raises(ValueError, r"backward_dtype is for FP8 tokens: a bfloat16 group's gradients are "
           r"bfloat16", lambda: mk(**kw, dtype=BF16, backward_dtype=torch.float32))
    raises(ValueError, r"scale_cols must be an int >= 0", lambda: mk(**kw, dtype=f8, scale_cols=-1))
    raises(ValueError, r"scale_dtype must be one of .*got torch.float64",
           lambda: mk(**kw, dtype=f8, scale_cols=1, scale_dtype=torch.float64))
    g = mk(**kw, dtype=f8, scale_cols=2, backward_dtype=torch.float32)
    if g.backward_dtype != torch.float32 or "scale_cols=2" not in repr(g):
        raise AssertionError(f"group attributes: {g!r}")
    x = torch.zeros((3, 16), device=dev).to(f8)
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32, device=dev)
    s = torch.ones((3, 2), device=dev)
    # 16-bit tokens are quantized 1x128 by the dispatch: scales ceil(H/128) float32, none given
    raises(ValueError, r"16-bit tokens into an FP8 group are quantized 1x128 by the dispatch: the "
           r"group needs scale_cols=1 \(ceil\(H/128\)\) of float32 and scales must be None; got "
           r"scale_cols=2 of torch.float32, scales given",
           lambda: ep.dispatch(x.to(BF16), ids, None, g, scales=s))
    x52 = torch.zeros((3, 16), dtype=torch.float8_e5m2, device=dev)
    raises(ValueError, r"x must be float8_e4m3fn, or bfloat16 / float16 to quantize, \[T, 16\], "
           r"got float8_e5m2 \[3, 16\]", lambda: ep.dispatch(x52, ids, None, g, scales=s))
    raises(ValueError, r"x must be float8_e4m3fn, or bfloat16 / float16 to quantize, \[T, 16\], "
           r"got float32 \[3, 16\]", lambda: ep.dispatch(x.float(), ids, None, g))
    raises(ValueError, r"scales must be float32 \[3, 2\] \(the group was made with "
           r"scale_cols=2: every dispatch takes scales\), got None",
           lambda: ep.dispatch(x, ids, None, g))
    raises(ValueError, r"scales must be float32 \[3, 2\], got float32 \[3, 1\]",
           lambda: ep.dispatch(x, ids, None, g, scales=s[:, :1]))
    raises(ValueError, r"scales must be float32 \[3, 2\], got bfloat16 \[3, 2\]",
           lambda: ep.dispatch(x, ids, None, g, scales=s.to(BF16)))
    raises(ValueError, r"scales must be float32 \[3, 2\], got float32 \[2, 2\]",
           lambda: ep.dispatch(x, ids, None, g, scales=s[:2]))
    raises(ValueError, r"dispatch of FP8 tokens \(float8_e4m3fn\) is forward-only: x must not "
           r"require grad", lambda: ep.dispatch(x.clone().requires_grad_(), ids, None, g, scales=s))
    if ctx.cuda:
        raises(ValueError, r"scales must be on cuda:\d \(x's device\), got cpu",
               lambda: ep.dispatch(x, ids, None, g, scales=s.cpu()))
    g16 = mk(**kw, dtype=BF16)
    raises(ValueError, r"scales given \(float32 \[3, 2\] on .*\), but the group was made without "
           r"scales \(scale_cols=0", lambda: ep.dispatch(x.to(BF16), ids, None, g16, scales=s))
    rows, _, _, h = ep.dispatch(x, ids, None, g, scales=s)  # every rank: a collective
    if ctx.backend == "nvlink":  # combine takes y of the gradient dtype there
        raises(ValueError, r"nvlink backend needs y of the group's gradient dtype float32",
               lambda: ep.combine(torch.zeros((g.capacity_rows, 16), dtype=BF16, device=dev), h))
        # FP8 rows of 8 bytes: the nvlink backend needs 16-byte rows (every rank fails)
        raises(Exception, r"16-byte token rows", lambda: mk(**{**kw, "hidden_size": 8}, dtype=f8))
    out = ep.combine(torch.ones((g.capacity_rows, 16), device=dev), h)
    eq("after the errors: combine", out, torch.full((3, 16), 2.0))


def check_fp8_from_16bit_tokens(ctx):
    """16-bit tokens into FP8 groups with 1x128 float32 scales: the dispatch
    quantizes them (bfloat16 -> e4m3, H 320 with a partial last block;
    float16 -> e5m2 with power-of-two scales), and the rows, row_scales,
    row_probs and counts are bitwise those of ops.quantize then the FP8
    dispatch, on another group of the same options; uneven T, a rank with
    none, special values; combine works on the handle."""
    W, dev = ctx.world, ctx.device
    T_list = tokens(W, 21, 0, 8)
    for dt, f8, pow2, H in ((BF16, torch.float8_e4m3fn, False, 320),
                            (torch.float16, torch.float8_e5m2, True, 256)):
        E, K = 4 * W, 3
        kw = dict(num_experts=E, topk=K, hidden_size=H, dtype=f8, scale_cols=-(-H // 128),
                  max_tokens_per_rank=max(T_list), backward_dtype=BF16)
        ga, gb = ctx.group(**kw), ctx.group(**kw)
        inp = make_inputs(T_list, E, K, H, BF16, "random", 23)[ctx.rank]
        x = (inp["x"].float() * 8).to(dt)
        if x.shape[0] >= 3:  # a zero row, a NaN and an inf, large values
            x[0] = 0
            x[1, 5], x[1, 130] = float("nan"), float("-inf")
            x[2] *= 1000 if dt == BF16 else 100
        x = x.to(dev)
        ids, p = inp["ids"].to(dev), inp["probs"].to(dev)
        rows, tpe, offs, h = ep.dispatch(x, ids, p, ga, pow2_scales=pow2)
        q, s = ops.quantize(x, "e4m3" if f8 == torch.float8_e4m3fn else "e5m2", "1x128", pow2)
        want, tpe2, offs2, h2 = ep.dispatch(q, ids, p, gb, scales=s)
        total = int(h2.total_rows)
        if rows.dtype != f8 or h.row_scales is None or h.row_scales.dtype != torch.float32:
            raise AssertionError(f"rows {rows.dtype}, row_scales {h.row_scales}")
        eq("tokens_per_expert", tpe, tpe2.cpu())
        eq("expert_row_offsets", offs, offs2.cpu())
        eq("total_rows", h.total_rows, h2.total_rows.cpu())
        eq("rows (bytes)", as_bytes(rows, total), as_bytes(want, total))
        eq("row_scales (bytes)", as_bytes(h.row_scales, total), as_bytes(h2.row_scales, total))
        eq("row_probs", h.row_probs[:total], h2.row_probs[:total].cpu())
        y = torch.ones((ga.capacity_rows, H), dtype=BF16, device=dev)
        eq("combine of the handle", ep.combine(y, h), ep.combine(y, h2).cpu())
    raises(ValueError, r"is forward-only: x must not require grad",
           lambda: ep.dispatch(x.clone().requires_grad_(), ids, p, ga))
    raises(ValueError, r"pow2_scales is for 16-bit tokens into an FP8 group",
           lambda: ep.dispatch(q, ids, p, gb, scales=s, pow2_scales=True))


CHECKS = {f.__name__[len("check_"):]: f for f in (
    check_fp8_e4m3_quantized_rows, check_fp8_e5m2_byte_scales_dropped, check_fp8_gradient_recipe,
    check_fp8_errors, check_fp8_from_16bit_tokens)}
