"""Multi-process checks of moeflow.ep (expert parallelism), run by test_ep.py.

``run(world, checks, ...)`` starts ``world`` processes (forkserver with torch
and moeflow preloaded, else spawn), each a rank of a torch.distributed
process group (gloo on the CPU, or nccl with one GPU per rank), runs the named
checks in order on every rank and returns {check: [error text per failing
rank]}. Every rank builds every rank's inputs from the same seeds, so each
computes the single-process oracle itself (moeflow.ops' Plan / permute /
unpermute over the gathered tokens, one plan per expert rank) and compares
its own share. Nothing waits forever: the process group has a timeout, the
parent a deadline after which it kills the ranks. The layer's checks live
in ep_worker_layer.py, the FP8 ones in ep_worker_fp8.py; GPU_CHECKS (a CUDA-graph capture of the EP layer, the
nvlink backend refused over NCCL's network transport) run only on GPUs.
"""
import gc
import os
import traceback

import torch
import torch.distributed as dist

import rank_runner

import moeflow.ep as ep
from moeflow import _C, ops
from moeflow.layer import MoELayer

PG_TIMEOUT_S = 20


class Ctx:
    def __init__(self, rank, world, backend, cuda):
        self.rank, self.world, self.backend, self.cuda = rank, world, backend, cuda
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def group(self, pg=None, **kw):
        kw.setdefault("backend", self.backend)
        return ep.Group(pg, **kw)


# ---------------------------------------------------------------------------
# Inputs of every rank and the single-process oracle.

def make_inputs(T_list, E, K, H, dtype, routing, seed):
    """Per rank: x [T, H], ids [T, K] int32 (distinct experts, some -1),
    probs [T, K] float32, dout [T, H], on the CPU."""
    W = len(T_list)
    L = E // W
    out = []
    for r, T in enumerate(T_list):
        g = torch.Generator().manual_seed(1000 * seed + r)
        x = torch.randn((T, H), generator=g).to(dtype)
        if routing == "one_rank":  # every slot on the last rank's experts
            ids = torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(T)]) + \
                (W - 1) * L if T else torch.empty((0, K), dtype=torch.int64)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
                if T else torch.empty((0, K), dtype=torch.int64)
            ids[torch.rand((T, K), generator=g) < (0.4 if routing == "sparse" else 0.1)] = -1
        probs = torch.rand((T, K), generator=g)
        dout = torch.randn((T, H), generator=g).to(dtype)
        out.append(dict(x=x, ids=ids.to(torch.int32), probs=probs, dout=dout))
    return out


def expert_outputs(W, cap, H, dtype, seed):
    """y [capacity, H] of every rank (the experts' outputs) and grad_rows."""
    ys, gs = [], []
    for q in range(W):
        g = torch.Generator().manual_seed(7919 * seed + q)
        ys.append(torch.randn((cap, H), generator=g).to(dtype))
        gs.append(torch.randn((cap, H), generator=g).to(dtype))
    return ys, gs


def ordered_sum(partials, anys, dtype):
    """sum over q ascending of partials[q] (float32), the first taken as is."""
    total = torch.zeros_like(partials[0])
    have = torch.zeros_like(anys[0])
    for p, a in zip(partials, anys):
        total = torch.where(a, torch.where(have, total + p, p), total)
        have = have | a
    return total.to(dtype)


class Oracle:
    """What every rank should see, computed in one process with moeflow.ops
    (CPU): rank q's receive layout is the Plan of its L experts over the
    gathered tokens (source rank major), with the group's align and capacity."""

    def __init__(self, inputs, E, align, cap):
        W = len(inputs)
        L = E // W
        self.W, self.L, self.cap = W, L, cap
        self.X = torch.cat([i["x"] for i in inputs])
        self.I = torch.cat([i["ids"] for i in inputs]).long()
        self.P = torch.cat([i["probs"] for i in inputs])
        self.D = torch.cat([i["dout"] for i in inputs])
        self.starts = [0]
        for i in inputs:
            self.starts.append(self.starts[-1] + i["x"].shape[0])
        self.plans, self.rows, self.row_probs = [], [], []
        for q in range(W):
            mine = (self.I >= q * L) & (self.I < (q + 1) * L)
            local = torch.where(mine, self.I - q * L, torch.full_like(self.I, -1))
            plan = ops.Plan(local.to(torch.int32), L, align, cap)
            rows, rp = ops.permute(self.X, plan, self.P)
            self.plans.append(plan)
            self.rows.append(rows)
            self.row_probs.append(rp)

    def mine(self, t, r):
        return t[self.starts[r]:self.starts[r + 1]]

    def _slot_any(self, q):
        return (self.plans[q].dest_row >= 0).any(1, keepdim=True)

    def home(self):
        """[N, 1] the rank each gathered token came from."""
        return torch.cat([torch.full((self.starts[r + 1] - self.starts[r], 1), r)
                          for r in range(self.W)])

    def rounded(self, q):
        """[N, 1] the tokens whose partial from rank q crosses the bfloat16
        wire rounded: q holds several of its slots and is not its home."""
        return ((self.plans[q].dest_row >= 0).sum(1, keepdim=True) > 1) & (self.home() != q)

    def combine(self, ys, weighted, dtype, wire=torch.float32):
        partials = [ops.unpermute(ys[q].float(), self.plans[q], self.P if weighted else None)
                    for q in range(self.W)]
        if wire == torch.bfloat16:
            partials = [torch.where(self.rounded(q), p.bfloat16().float(), p)
                        for q, p in enumerate(partials)]
        return ordered_sum(partials, [self._slot_any(q) for q in range(self.W)], dtype)

    def grad_y(self, q, weighted, dtype):
        drows, dp = ops.permute(self.D, self.plans[q], self.P)
        return (dp.unsqueeze(1) * drows.float()).to(dtype) if weighted else drows.to(dtype)

    def dprobs(self, ys):
        out = torch.zeros(self.I.shape, dtype=torch.float64)
        for q in range(self.W):
            rows = self.plans[q].dest_row
            vals = (self.D.double().unsqueeze(1) * ys[q].double()[rows.clamp(min=0)]).sum(-1)
            out = torch.where(rows >= 0, vals, out)
        return out.float()


def eq(name, got, want):
    """Bitwise equality (dtype, shape, values); the message shows where not."""
    got = got.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{name}: got {got.dtype} {list(got.shape)}, want {want.dtype} "
                             f"{list(want.shape)}")
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {bad.shape[0]} element(s) differ, first at {list(i)}: "
                             f"got {got[i].item()}, want {want[i].item()}")


def close(name, got, want, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(got.detach().cpu(), want, rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------
# dispatch / combine forward and backward against the oracle.

class Roundtrip:
    """One dispatch -> combine (weighted and unweighted) with backward, split
    in steps so that several can be interleaved."""

    def __init__(self, ctx, T_list, E, K, H, dtype, align=16, capacity_rows=-1,
                 routing="random", seed=0, int64_ids=False, wire=torch.float32):
        self.ctx, self.dtype, self.K, self.wire = ctx, dtype, K, wire
        W, r = ctx.world, ctx.rank
        self.g = ctx.group(num_experts=E, topk=K, hidden_size=H, dtype=dtype,
                           max_tokens_per_rank=max(T_list + [1]), align=align,
                           capacity_rows=capacity_rows, combine_wire_dtype=wire)
        cap = self.g.capacity_rows
        inputs = make_inputs(T_list, E, K, H, dtype, routing, seed)
        self.o = Oracle(inputs, E, align, cap)
        self.ys, self.gs = expert_outputs(W, cap, H, dtype, seed)
        dev = ctx.device
        mine = inputs[r]
        self.x = mine["x"].to(dev).clone().requires_grad_()
        self.ids = mine["ids"].to(dev).to(torch.int64 if int64_ids else torch.int32)
        self.p = mine["probs"].to(dev).clone().requires_grad_()
        self.dout = mine["dout"].to(dev)
        self.y = self.ys[r].to(dev).clone().requires_grad_()
        self.y2 = self.ys[r].to(dev).clone().requires_grad_()

    def dispatch(self):
        self.rows, self.tpe, self.offs, self.h = ep.dispatch(self.x, self.ids, self.p, self.g)

    def combine(self):
        self.out = ep.combine(self.y, self.h, self.p)
        self.out2 = ep.combine(self.y2, self.h)  # unweighted

    def backward(self):
        # The same order on every rank: these are collectives.
        self.out.backward(self.dout)
        self.out2.backward(self.dout)
        self.rows.backward(self.gs[self.ctx.rank].to(self.ctx.device))

    def verify(self):
        o, r, dt = self.o, self.ctx.rank, self.dtype
        plan = o.plans[r]
        total = int(plan.total_rows)
        eq("tokens_per_expert", self.tpe, plan.tokens_per_expert)
        eq("expert_row_offsets", self.offs, plan.expert_row_offsets)
        eq("handle.tokens_per_expert", self.h.tokens_per_expert, plan.tokens_per_expert)
        eq("total_rows", self.h.total_rows, plan.total_rows)
        eq("overflow", self.h.overflow, plan.overflow)
        eq("rows", self.rows[:total], o.rows[r][:total])
        eq("row_probs", self.h.row_probs[:total], o.row_probs[r][:total])
        wire = self.wire
        eq("combine (weighted)", self.out, o.mine(o.combine(self.ys, True, dt, wire), r))
        eq("combine (unweighted)", self.out2, o.mine(o.combine(self.ys, False, dt, wire), r))
        eq("dispatch backward", self.x.grad, o.mine(o.combine(self.gs, False, dt, wire), r))
        eq("combine backward grad_y (weighted)", self.y.grad[:total], o.grad_y(r, True, dt)[:total])
        eq("combine backward grad_y (unweighted)", self.y2.grad[:total],
           o.grad_y(r, False, dt)[:total])
        close("combine backward dprobs", self.p.grad, o.mine(o.dprobs(self.ys), r))

    def run(self):
        self.dispatch()
        self.combine()
        self.backward()
        self.verify()
        return self


def tokens(world, *T):
    """T per rank: the given counts, cycled to the world size."""
    return [T[i % len(T)] for i in range(world)]


def check_uneven_bf16(ctx):  # uneven T, a rank with T = 0, K > L
    W = ctx.world
    Roundtrip(ctx, tokens(W, 13, 0, 7), E=2 * W, K=3, H=24, dtype=torch.bfloat16).run()


def check_float32_align1_int64_ids(ctx):
    # float32 outputs and K = 3: the order of the ranks' partials shows (W = 3).
    W = ctx.world
    Roundtrip(ctx, tokens(W, 15, 9, 1), E=3 * W, K=3, H=16, dtype=torch.float32, align=1,
              int64_ids=True, seed=1).run()


def check_all_to_one_rank(ctx):
    W = ctx.world
    rt = Roundtrip(ctx, tokens(W, 6, 3), E=4 * W, K=2, H=24, dtype=torch.bfloat16,
                   routing="one_rank", seed=2).run()
    if ctx.rank != W - 1:
        eq("a rank with no slots: total_rows", rt.h.total_rows.cpu(),
           torch.zeros(1, dtype=torch.int64))


def check_dropped_slots(ctx):
    W = ctx.world
    rt = Roundtrip(ctx, tokens(W, 24, 20), E=3 * W, K=2, H=24, dtype=torch.bfloat16,
                   capacity_rows=32, seed=3).run()
    dropped = torch.tensor([int(p.overflow) for p in rt.o.plans])
    if int(dropped.sum()) == 0:
        raise AssertionError("the small capacity dropped nothing: the check checks nothing")


def check_bf16_combine_wire(ctx):
    # combine_wire_dtype=bfloat16: a peer's partial of several slots rounded
    # once; bf16 and float32 experts' outputs, uneven T with a 0.
    W = ctx.world
    for dt, seed in ((torch.bfloat16, 5), (torch.float32, 6)):
        rt = Roundtrip(ctx, tokens(W, 17, 0, 9), E=2 * W, K=3, H=24, dtype=dt, seed=seed,
                       wire=torch.bfloat16).run()
        if not any(bool(rt.o.rounded(q).any()) for q in range(W)):
            raise AssertionError("no partial crossed rounded: the check checks nothing")


def check_sparse_top1(ctx):  # many unrouted slots, top-1, E = W (one expert per rank)
    W = ctx.world
    Roundtrip(ctx, tokens(W, 8, 3), E=W, K=1, H=8, dtype=torch.float32, align=16,
              routing="sparse", seed=4).run()


def check_two_in_flight(ctx):
    """dispatch A, dispatch B, combine B, combine A, backward B, backward A."""
    W = ctx.world
    a = Roundtrip(ctx, tokens(W, 9, 4, 0), E=2 * W, K=2, H=24, dtype=torch.bfloat16, seed=5)
    b = Roundtrip(ctx, tokens(W, 3, 12), E=2 * W, K=2, H=24, dtype=torch.bfloat16, seed=6)
    a.dispatch()
    b.dispatch()
    b.combine()
    a.combine()
    b.backward()
    a.backward()
    b.verify()
    a.verify()


def check_w1_matches_ops(ctx):
    """A one-rank group (a subgroup per rank) is exactly ops.Plan + permute +
    unpermute over the E experts."""
    subs = [dist.new_group([q]) for q in range(ctx.world)]
    g = ctx.group(subs[ctx.rank], num_experts=4, topk=2, hidden_size=24, dtype=torch.bfloat16,
                  max_tokens_per_rank=30)
    inp = make_inputs([17 + ctx.rank], 4, 2, 24, torch.bfloat16, "random", 8 + ctx.rank)[0]
    dev = ctx.device
    x, ids = inp["x"].to(dev), inp["ids"].to(dev)
    p = inp["probs"].to(dev).clone().requires_grad_()
    rows, tpe, offs, h = ep.dispatch(x, ids, p, g)
    plan = ops.Plan(inp["ids"], 4, 16, g.capacity_rows)
    want, want_p = ops.permute(inp["x"], plan, inp["probs"])
    total = int(plan.total_rows)
    eq("rows", rows[:total], want[:total])
    eq("row_probs", h.row_probs[:total], want_p[:total])
    eq("expert_row_offsets", offs, plan.expert_row_offsets)
    y = torch.randn((g.capacity_rows, 24)).to(torch.bfloat16)
    yd = y.to(dev).clone().requires_grad_()
    out = ep.combine(yd, h, p)
    out.backward(inp["dout"].to(dev))
    yr, pr = y.clone().requires_grad_(), inp["probs"].clone().requires_grad_()
    ref = ops.unpermute(yr, plan, pr)
    ref.backward(inp["dout"])
    eq("combine == unpermute", out, ref.detach())
    eq("grad_y", yd.grad[:total], yr.grad[:total])
    close("dprobs", p.grad, pr.grad)


class _Block(torch.nn.Module):
    """dispatch -> the local experts' grouped MLP -> combine."""

    def __init__(self, g, F, dev):
        super().__init__()
        gen = torch.Generator().manual_seed(11 + g.rank)
        L, H = g.local_experts, g.hidden_size
        self.g = g
        self.fc1 = torch.nn.Parameter((torch.randn((L, 2 * F, H), generator=gen) / H ** 0.5)
                                      .to(g.dtype).to(dev))
        self.fc2 = torch.nn.Parameter((torch.randn((L, H, F), generator=gen) / F ** 0.5)
                                      .to(g.dtype).to(dev))

    def forward(self, x, ids, probs):
        rows, tpe, offs, h = ep.dispatch(x, ids, probs, self.g)
        y = ops.grouped_mlp(rows, self.fc1, self.fc2, offsets=offs, real_rows=tpe)
        return ep.combine(y, h, probs)


def check_activation_recomputation(ctx):
    from torch.utils.checkpoint import checkpoint
    W = ctx.world
    g = ctx.group(num_experts=2 * W, topk=2, hidden_size=32, dtype=torch.bfloat16,
                  max_tokens_per_rank=16)
    blk = _Block(g, 16, ctx.device)
    inp = make_inputs(tokens(W, 10, 0, 6), 2 * W, 2, 32, torch.bfloat16, "random", 9)[ctx.rank]
    grads = []
    for mode in ("plain", "non-reentrant", "reentrant"):
        blk.zero_grad(set_to_none=True)
        x = inp["x"].to(ctx.device).clone().requires_grad_()
        p = inp["probs"].to(ctx.device).clone().requires_grad_()
        ids = inp["ids"].to(ctx.device)
        if mode == "plain":
            out = blk(x, ids, p)
        else:
            out = checkpoint(blk, x, ids, p, use_reentrant=(mode == "reentrant"))
        out.backward(inp["dout"].to(ctx.device))
        grads.append([t.detach().clone() for t in (out, x.grad, p.grad, blk.fc1.grad,
                                                   blk.fc2.grad)])
    names = ["out", "x.grad", "probs.grad", "fc1.grad", "fc2.grad"]
    for mode, gs in zip(("non-reentrant", "reentrant"), grads[1:]):
        for n, a, b in zip(names, gs, grads[0]):
            eq(f"{mode} checkpoint: {n}", a, b.cpu())
    if float(grads[0][3].float().abs().sum()) == 0 and ctx.rank == 0:
        raise AssertionError("fc1 got no gradient: the check checks nothing")


def rel_err(got, want):
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def raises(exc, match, fn):
    import re
    try:
        fn()
    except exc as e:
        if not re.search(match, str(e)):
            raise AssertionError(f"{exc.__name__} raised, but {str(e)!r} does not match "
                                 f"{match!r}") from e
        return
    raise AssertionError(f"no {exc.__name__} matching {match!r} raised")


def check_errors(ctx):
    W = ctx.world
    kw = dict(num_experts=2 * W, topk=2, hidden_size=8, dtype=torch.float32,
              max_tokens_per_rank=4)
    mk = ctx.group
    raises(ValueError, r"num_experts must be a positive multiple of the world size",
           lambda: mk(**{**kw, "num_experts": 2 * W + 1}))
    raises(ValueError, r"backend must be one of", lambda: mk(**{**kw, "backend": "mpi"}))
    raises(ValueError, r"combine_wire_dtype must be torch.float32 or torch.bfloat16",
           lambda: mk(**{**kw, "combine_wire_dtype": torch.float16}))
    raises(ValueError, r"combine_wire_dtype=torch.bfloat16 needs hidden_size % 8 == 0",
           lambda: mk(**{**kw, "hidden_size": 12, "combine_wire_dtype": torch.bfloat16}))
    raises(ValueError, r"align must be one of \(1, 16", lambda: mk(**{**kw, "align": 3}))
    raises(ValueError, r"capacity_rows must be .* multiple of align=16, got 20",
           lambda: mk(**{**kw, "capacity_rows": 20}))
    raises(ValueError, r"topk must be in \[1, ", lambda: mk(**{**kw, "topk": 0}))
    raises(ValueError, r"dtype must be .*got torch.int32",
           lambda: mk(**{**kw, "dtype": torch.int32}))
    if ctx.backend == "reference":
        raises(ValueError, r"reference backend takes no options",
               lambda: mk(**kw, pipeline_chunks=2))
    if not torch.cuda.is_available() or not hasattr(_C, "EpGroup"):
        raises(RuntimeError, r"needs (moeflow's expert-parallel extension|a CUDA device)",
               lambda: mk(**{**kw, "backend": "nccl"}))
    g = mk(**kw)
    dev = ctx.device
    x = torch.zeros((3, 8), device=dev)
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32, device=dev)
    p = torch.zeros((3, 2), device=dev)
    raises(ValueError, r"x must be float32 \[T, 8\], got bfloat16 \[3, 8\]",
           lambda: ep.dispatch(x.bfloat16(), ids, p, g))
    raises(ValueError, r"x must be float32 \[T, 8\], got float32 \[3, 4\]",
           lambda: ep.dispatch(x[:, :4], ids, p, g))
    raises(ValueError, r"x has 5 tokens, more than the group's max_tokens_per_rank=4",
           lambda: ep.dispatch(torch.zeros((5, 8), device=dev), ids, p, g))
    raises(ValueError, r"topk_ids must be int32 or int64 \[3, 2\], got float32 \[3, 2\]",
           lambda: ep.dispatch(x, ids.float(), p, g))
    raises(ValueError, r"topk_ids must be int32 or int64 \[3, 2\], got int32 \[3, 1\]",
           lambda: ep.dispatch(x, ids[:, :1], p, g))
    raises(ValueError, r"probs must be float32 \[3, 2\] or None, got float16",
           lambda: ep.dispatch(x, ids, p.half(), g))
    raises(TypeError, r"group must be a moeflow.ep.Group", lambda: ep.dispatch(x, ids, p, None))
    rows, tpe, offs, h = ep.dispatch(x, ids, p, g)  # every rank: a collective
    y = torch.randn((g.capacity_rows, 8), generator=torch.Generator().manual_seed(1)).to(dev)
    raises(ValueError, r"y must be float32, float16 or bfloat16 \[\d+, 8\], got float32 \[3, 8\]",
           lambda: ep.combine(x, h, p))
    raises(ValueError, r"probs must be the tensor given to the handle's dispatch",
           lambda: ep.combine(y, h, p.clone()))
    raises(ValueError, r"probs must be float32 \[3, 2\] or None, got float32 \[2, 2\]",
           lambda: ep.combine(y, h, p[:2]))
    raises(TypeError, r"handle must be the moeflow.ep.EpHandle", lambda: ep.combine(y, None))
    out = ep.combine(y, h, p)  # the handle still works
    _, _, _, h2 = ep.dispatch(x, ids, None, g)
    raises(ValueError, r"the handle's dispatch had none", lambda: ep.combine(y, h2, p))
    ep.combine(y, h2)
    raises(ValueError, rf"ep_group.num_experts must equal the layer's num_experts={4 * W}",
           lambda: MoELayer(8, 4, 4 * W, 2, params_dtype=torch.bfloat16, ep_group=g))
    raises(ValueError, r"ep_group.dtype must equal the layer's params_dtype",
           lambda: MoELayer(8, 4, 2 * W, 2, params_dtype=torch.bfloat16, ep_group=g))
    # An id out of range: that rank raises once the dispatch is complete (no
    # rank waits), the slot counted as unrouted; the group goes on working.
    # (The nvlink backend counts such ids on the device instead: moeflow/ep.h.)
    bad = ids.clone()
    bad[1, 1] = 2 * W
    if ctx.backend == "reference" and ctx.rank == 0:
        raises(ValueError, rf"topk_ids\[1, 1\] = {2 * W} is outside \[-1, {2 * W}\)",
               lambda: ep.dispatch(x, bad, p, g))
    elif ctx.backend == "nccl" and ctx.rank == 0:
        raises(Exception, rf"outside \[-1, {2 * W}\)", lambda: ep.dispatch(x, bad, p, g))
    else:
        ep.dispatch(x, ids, p, g)
    _, _, _, h3 = ep.dispatch(x, ids, p, g)
    eq("after an error", ep.combine(y, h3, p), out.detach().cpu())


CHECKS = {f.__name__[len("check_"):]: f for f in (
    check_uneven_bf16, check_float32_align1_int64_ids, check_all_to_one_rank, check_dropped_slots,
    check_sparse_top1, check_bf16_combine_wire, check_two_in_flight, check_w1_matches_ops, check_activation_recomputation,
    check_errors)}


# ---------------------------------------------------------------------------
# GPU only, for the backends test_ep.py names.

# Each rank its own NCCL "host": NCCL connects the ranks through its network
# transport (sockets over the loopback interface), as between nodes.
NET_ENV = {"NCCL_HOSTID": "moeflow-ep-test-node-{rank}", "NCCL_P2P_DISABLE": "1",
           "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype.is_floating_point else t


def check_layer_cuda_graph(ctx, wire8=False, in_dispatch=-1):
    """A training step of the EP MoELayer (router with aux losses, dispatch,
    the local experts, combine, all of backward) captured in one CUDA graph
    after eager warm-up steps (they leave a handle state in the group's pool
    for the captured dispatch: nothing is allocated during capture), then
    replayed with new tokens copied into the static inputs: out, x.grad and
    every parameter's gradient bitwise those of an eager step on the same
    tokens. Backend nvlink (nccl's dispatch synchronises with the host).
    wire8: an FP8 group and fp8-blockwise experts (the tokens quantized on
    their way, where ``nvlink_quantize_in_dispatch`` says)."""
    r, dev, dt = ctx.rank, ctx.device, torch.bfloat16
    E, K, H, F = 4 * ctx.world, 2, (128 if wire8 else 64), (128 if wire8 else 32)
    T = (48, 40, 33, 45)[r % 4]  # differs per rank
    wire = dict(dtype=torch.float8_e4m3fn, scale_cols=H // 128,
                nvlink_quantize_in_dispatch=in_dispatch) if wire8 else dict(dtype=dt)
    g = ctx.group(num_experts=E, topk=K, hidden_size=H, max_tokens_per_rank=48, **wire)
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, K, params_dtype=dt, device=dev, ep_group=g, aux_loss_coeff=1e-2,
                     z_loss_coeff=1e-3, **(dict(precision="fp8-blockwise") if wire8 else {}))
    static_x = torch.zeros((T, H), dtype=dt, device=dev, requires_grad=True)
    static_dout = torch.zeros((T, H), dtype=dt, device=dev)

    def load(seed):
        gen = torch.Generator().manual_seed(100 * seed + r)
        with torch.no_grad():
            static_x.copy_(torch.randn((T, H), generator=gen).to(dt))
            static_dout.copy_(torch.randn((T, H), generator=gen).to(dt))

    def clear():
        static_x.grad = None
        for p in layer.parameters():
            p.grad = None

    def step():
        out = layer(static_x)
        out.backward(static_dout)
        return out.detach()  # the autograd graph (and the dispatch's handle) go

    def grads():
        return {"x.grad": static_x.grad, **{f"{n}.grad": p.grad
                                            for n, p in layer.named_parameters()}}

    load(0)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            clear()
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the process group's watchdog thread may query its events
    # meanwhile (no collective of it runs in the step)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_out = step()
    static = grads()  # written by the graph (allocated in its pool)
    missing = [n for n, t in static.items() if t is None]
    if missing:
        raise AssertionError(f"no gradient captured for {missing}")
    outs = []
    for seed in (1, 2):
        load(seed)
        graph.replay()
        torch.cuda.synchronize(dev)
        got = {"out": static_out.clone(), **{n: t.clone() for n, t in static.items()}}
        clear()
        want = {"out": step(), **grads()}
        torch.cuda.synchronize(dev)
        for n, t in got.items():
            eq(f"replay {seed}: {n} (bits)", _bits(t), _bits(want[n]))
        outs.append(got["out"])
    if T and torch.equal(outs[0], outs[1]):
        raise AssertionError("two replays with different tokens gave the same output")


def check_layer_fp8_wire_cuda_graph(ctx):
    # the tokens quantized in the dispatch kernel, then into staging rows first
    check_layer_cuda_graph(ctx, wire8=True, in_dispatch=1)
    check_layer_cuda_graph(ctx, wire8=True, in_dispatch=0)


def check_nvlink_needs_one_node(ctx):
    """Run with NET_ENV (every rank its own NCCL host): making an nvlink group
    fails on every rank with an error that says why, rather than waiting, and
    the ranks go on with the nccl backend."""
    W = ctx.world
    kw = dict(num_experts=2 * W, topk=2, hidden_size=64, dtype=torch.bfloat16,
              max_tokens_per_rank=8)
    raises(_C.Error, r"the nvlink backend needs (NCCL symmetric memory|the NCCL device API|"
           r"all ranks in one NVLink domain)", lambda: ctx.group(**{**kw, "backend": "nvlink"}))
    Roundtrip(Ctx(ctx.rank, W, "nccl", ctx.cuda), tokens(W, 7, 3), E=2 * W, K=2, H=24,
              dtype=torch.bfloat16, seed=30).run()


GPU_CHECKS = {f.__name__[len("check_"):]: f for f in (
    check_layer_cuda_graph, check_layer_fp8_wire_cuda_graph, check_nvlink_needs_one_node)}


def cpu_checks():
    """The checks of every backend by name: these, the layer's (ep_worker_layer)
    and the FP8 ones (ep_worker_fp8)."""
    import ep_worker_fp8
    import ep_worker_layer
    return {**CHECKS, **ep_worker_layer.CHECKS, **ep_worker_fp8.CHECKS}


def all_checks():
    """Every check by name: cpu_checks() and the GPU-only ones."""
    return {**cpu_checks(), **GPU_CHECKS}


# ---------------------------------------------------------------------------
# The processes.

def _worker(rank, world, port, backend, cuda, names, env, queue):
    results = {}
    try:
        torch.set_num_threads(1)
        # (before NCCL starts in this process: it reads them once)
        os.environ.update({k: v.format(rank=rank) for k, v in (env or {}).items()})
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        rank_runner.init_process_group(rank, world, port, cuda, PG_TIMEOUT_S)
        rank_runner.run_checks(all_checks(), names, Ctx(rank, world, backend, cuda), world,
                               results)
        gc.collect()  # the device backends' groups go before the process group
        dist.destroy_process_group()
    except Exception:
        results["<setup>"] = traceback.format_exc()
    queue.put((rank, results))


def run(world, names=None, *, backend="reference", cuda=False, deadline_s=120.0, env=None):
    """Runs the checks on `world` ranks. Returns {check: [errors]} (empty lists
    where every rank passed) or raises when the ranks did not report in time.
    names: of all_checks() (None: CHECKS and the FP8 ones); env: variables set
    in every rank process before its process group starts ("{rank}" in a
    value becomes the rank)."""
    if names is None:
        names = list(cpu_checks())
    names = list(names)
    # The server imports torch and moeflow once; each rank is forked from it.
    ctx = rank_runner.mp_context(["torch", "torch.distributed", "moeflow.ep", "moeflow.layer",
                                  "ep_worker", "ep_worker_layer", "ep_worker_fp8"])
    for attempt in range(3):
        reports = rank_runner.run_ranks(ctx, _worker, world,
                                        (world, rank_runner.free_port(), backend, cuda, names,
                                         dict(env or {})),
                                        deadline_s)
        # The free port can be taken by another process before rank 0 listens
        # on it: then again with another port.
        if not any("EADDRINUSE" in str(rep.get("<setup>") or "") for rep in reports.values()):
            break
    out = {}
    for name in names + ["<setup>"]:
        errs = [f"rank {r}: {reports[r].get(name, 'not run (see <setup>)')}"
                for r in sorted(reports) if name == "<setup>" and reports[r].get(name)
                or name != "<setup>" and (name not in reports[r] or reports[r][name])]
        if errs or name != "<setup>":
            out[name] = errs
    return out
