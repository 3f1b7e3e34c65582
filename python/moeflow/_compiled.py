"""MoELayer's ops as torch custom operators, for torch.compile.

While Dynamo traces a MoELayer whose configuration they cover (``unsupported``
says which do not), the layer calls these instead of moeflow.ops: each is a
``torch.library`` custom operator with a fake (shape) function and its
backward registered, so the layer joins the compiled graph, ``fullgraph=True``
included. They call the same kernels in the same order as the eager path,
so results and gradients are the same bits (docs/python.md, "torch.compile").
Shapes are static: a new token count is a new graph.

No ``from __future__ import annotations`` here: torch < 2.7 infers an
operator's schema from its evaluated annotations only."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _router_ops
from ._ops_common import _plan_sizes, _router_ws_bytes, _stream
from ._router_ops import RouterOutput

_f32, _i32, _i64 = torch.float32, torch.int32, torch.int64


def unsupported(layer) -> Optional[str]:
    """Why the layer's configuration has no compiled path (None: it has one)."""
    for reason, off in (("precision other than bf16", layer.precision == "bf16"),
                        ("ep_group", layer.ep_group is None),
                        ("delay_wgrad_compute", not layer.delay_wgrad_compute),
                        ("gradient_accumulation_fusion", not layer.gradient_accumulation_fusion)):
        if not off:
            return reason
    return None


# --- the gating GEMM (ops.router_logits) ------------------------------------

def _split(x: Tensor, weight: Tensor) -> bool:
    return x.dtype == torch.bfloat16 and weight.dtype == _f32


@torch.library.custom_op("moeflow::router_logits", mutates_args=())
def _router_logits(x: Tensor, weight: Tensor) -> Tensor:
    return _router_ops._logits_forward(x, weight, _split(x, weight))


@_router_logits.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=_f32)


@torch.library.custom_op("moeflow::router_logits_backward", mutates_args=())
def _router_logits_backward(dlogits: Tensor, x: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor]:
    return _router_ops._logits_backward(dlogits, x, weight, _split(x, weight), True, True)


@_router_logits_backward.register_fake
def _(dlogits, x, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)  # contiguous, as the real ones


def _router_logits_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _router_logits_grad(ctx, dlogits):
    x, weight = ctx.saved_tensors
    return _router_logits_backward(dlogits, x, weight)


_router_logits.register_autograd(_router_logits_grad, setup_context=_router_logits_setup)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    return _router_logits(x, weight)


# --- the router (ops.router) ------------------------------------------------

def _seq_rows(cu_seqlens: Optional[Tensor]) -> int:
    return 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("moeflow::router", mutates_args=())
def _router(logits: Tensor, expert_bias: Optional[Tensor], padding_mask: Optional[Tensor],
            cu_seqlens: Optional[Tensor], num_experts: int, topk: int, score_function: str,
            pre_softmax: bool, num_groups: int, group_topk: int, scaling: float,
            aux_loss_coeff: float, z_loss_coeff: float, seq_aux_loss_coeff: float
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(ids [T, K], probs [T, K], counts [E + 1] (tokens per expert, then the
    non-finite count), aux, z, seq (0-dim; zero where the coefficient is 0),
    the sequences' counts [S, E])."""
    cfg = (num_experts, topk, score_function, pre_softmax, num_groups, group_topk, scaling,
           aux_loss_coeff, z_loss_coeff, seq_aux_loss_coeff)
    logits = logits.contiguous()
    T, K, E, dev, dt = logits.shape[0], topk, num_experts, logits.device, logits.dtype
    ids = torch.empty(T, K, dtype=_i32, device=dev)
    probs = torch.empty(T, K, dtype=dt, device=dev)
    counts = torch.empty(E + 1, dtype=_i32, device=dev)
    aux, z, seq = (torch.zeros((), dtype=dt, device=dev) for _ in range(3))
    S = _seq_rows(cu_seqlens)
    seq_tpe = torch.empty(S if seq_aux_loss_coeff else 0, E, dtype=_i32, device=dev)
    ws = None
    if logits.is_cuda:
        ws_bytes = _router_ws_bytes(T, *cfg, S)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    _C.router_forward(logits, *cfg, ids, probs, counts[:E],
                      aux.view(1) if aux_loss_coeff else None,
                      z.view(1) if z_loss_coeff else None,
                      seq.view(1) if seq_aux_loss_coeff else None,
                      seq_tpe if seq_aux_loss_coeff else None, counts[E:], None, expert_bias,
                      padding_mask, cu_seqlens, ws, _stream(logits))
    return ids, probs, counts, aux, z, seq, seq_tpe


@_router.register_fake
def _(logits, expert_bias, padding_mask, cu_seqlens, num_experts, topk, score_function,
      pre_softmax, num_groups, group_topk, scaling, aux_loss_coeff, z_loss_coeff,
      seq_aux_loss_coeff):
    T, dt = logits.shape[0], logits.dtype
    S = _seq_rows(cu_seqlens) if seq_aux_loss_coeff else 0
    return (logits.new_empty((T, topk), dtype=_i32), logits.new_empty((T, topk), dtype=dt),
            logits.new_empty((num_experts + 1,), dtype=_i32), logits.new_empty((), dtype=dt),
            logits.new_empty((), dtype=dt), logits.new_empty((), dtype=dt),
            logits.new_empty((S, num_experts), dtype=_i32))


@torch.library.custom_op("moeflow::router_backward", mutates_args=())
def _router_backward(logits: Tensor, ids: Tensor, counts: Tensor, padding_mask: Optional[Tensor],
                     cu_seqlens: Optional[Tensor], seq_tpe: Tensor, dprobs: Tensor,
                     daux: Optional[Tensor], dz: Optional[Tensor], dseq: Optional[Tensor],
                     cfg_ints: List[int], score_function: str, pre_softmax: bool,
                     cfg_floats: List[float]) -> Tensor:
    E, K, num_groups, group_topk = cfg_ints
    scaling, aux_c, z_c, seq_c = cfg_floats
    logits = logits.contiguous()
    dlogits = torch.empty_like(logits)
    losses = aux_c != 0 or z_c != 0 or seq_c != 0

    def one(g, coeff):
        return None if g is None or not coeff else g.reshape(1).contiguous()

    _C.router_backward(logits, ids, counts[:E] if losses else None, E, K, score_function,
                       pre_softmax, num_groups, group_topk, scaling, aux_c, z_c, seq_c,
                       dprobs.contiguous(), one(daux, aux_c), one(dz, z_c), one(dseq, seq_c),
                       padding_mask, cu_seqlens if seq_c else None,
                       seq_tpe if seq_c else None, dlogits, _stream(logits))
    return dlogits


@_router_backward.register_fake
def _(logits, *args):
    return logits.new_empty(logits.shape)


def _router_setup(ctx, inputs, output):
    logits, bias, mask, cu = inputs[:4]
    (E, K, score, pre, ng, gt, scaling, aux_c, z_c, seq_c) = inputs[4:]
    ids, _, counts, _, _, _, seq_tpe = output
    ctx.save_for_backward(logits, ids, counts, mask, cu, seq_tpe)
    ctx.cfg = ([E, K, ng, gt], score, pre, [scaling, aux_c, z_c, seq_c])


def _router_grad(ctx, d_ids, dprobs, d_counts, daux, dz, dseq, d_seq_tpe):
    logits, ids, counts, mask, cu, seq_tpe = ctx.saved_tensors
    if dprobs is None:
        dprobs = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device)
    ints, score, pre, floats = ctx.cfg
    dlogits = _router_backward(logits, ids, counts, mask, cu, seq_tpe, dprobs, daux, dz, dseq,
                               ints, score, pre, floats)
    return (dlogits,) + (None,) * 13


_router.register_autograd(_router_grad, setup_context=_router_setup)


def router(logits: Tensor, topk: int, *, score_function: str = "softmax",
           pre_softmax: bool = False, num_groups: Optional[int] = 0,
           group_topk: Optional[int] = 0, topk_scaling_factor: Optional[float] = None,
           expert_bias: Optional[Tensor] = None, aux_loss_coeff: float = 0.0,
           z_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0,
           padding_mask: Optional[Tensor] = None,
           cu_seqlens: Optional[Tensor] = None) -> RouterOutput:
    """ops.router's signature and result."""
    E = logits.shape[1]
    ids, probs, counts, aux, z, seq, _ = _router(
        logits, None if expert_bias is None else expert_bias.detach(),
        None if padding_mask is None else padding_mask.contiguous(),
        None if cu_seqlens is None else cu_seqlens.contiguous(), E, int(topk),
        str(score_function), bool(pre_softmax),
        int(num_groups or 0), int(group_topk or 0),
        1.0 if topk_scaling_factor is None else float(topk_scaling_factor),
        float(aux_loss_coeff), float(z_loss_coeff), float(seq_aux_loss_coeff))
    return RouterOutput(ids, probs, counts[:E], aux if aux_loss_coeff else None,
                        z if z_loss_coeff else None, seq if seq_aux_loss_coeff else None,
                        counts[E:])


@torch.library.custom_op("moeflow::update_expert_bias", mutates_args=("expert_bias",))
def _update_expert_bias(tokens_per_expert: Tensor, expert_bias: Tensor, rate: float) -> None:
    _C.router_update_expert_bias(tokens_per_expert.contiguous(), expert_bias, rate,
                                 _stream(expert_bias))


@_update_expert_bias.register_fake
def _(tokens_per_expert, expert_bias, rate):
    return None


def update_expert_bias(tokens_per_expert: Tensor, expert_bias: Tensor, rate: float) -> Tensor:
    _update_expert_bias(tokens_per_expert, expert_bias, float(rate))
    return expert_bias


@torch.library.custom_op("moeflow::apply_capacity", mutates_args=())
def _apply_capacity(topk_ids: Tensor, probs: Tensor, num_experts: int, capacity_factor: float,
                    drop_policy: str) -> Tuple[Tensor, Tensor]:
    return _router_ops.apply_capacity(topk_ids, probs, num_experts, capacity_factor, drop_policy)


@_apply_capacity.register_fake
def _(topk_ids, probs, num_experts, capacity_factor, drop_policy):
    return (topk_ids.new_empty(tuple(topk_ids.shape), dtype=_i32),
            topk_ids.new_empty((1,), dtype=_i32))


def apply_capacity(topk_ids: Tensor, probs: Optional[Tensor], num_experts: int,
                   capacity_factor: float, drop_policy: str = "probs") -> Tuple[Tensor, Tensor]:
    """ops.apply_capacity's signature and result (probs given, as the layer does)."""
    return _apply_capacity(topk_ids, probs.detach(), int(num_experts), float(capacity_factor),
                           str(drop_policy))


# --- the experts: plan, permute, grouped MLP, unpermute (one node) ----------

def _plan_layout(T: int, K: int, E: int, align: int):
    return _plan_sizes(int(T), int(K), int(E), int(align), -1)


def _groups(ids: Optional[Tensor], E: int, align: int, plan64: Tensor, plan32: Tensor):
    """(offsets, real_rows, the C++ plan or None) of the experts' rows: a
    plan's, or without ids one group of all the tokens (plan64 its offsets)."""
    if ids is None:
        return plan64, None, None
    T, K = ids.shape
    _, _, p64, p32 = _plan_layout(T, K, E, align)
    view = _C.PlanView.from_buffers(T, K, E, align, -1, plan64, plan32)
    return plan64.split_with_sizes(p64)[0], plan32.split_with_sizes(p32)[0], view


@torch.library.custom_op("moeflow::experts", mutates_args=())
def _experts(x: Tensor, ids: Optional[Tensor], probs: Optional[Tensor], fc1: Tensor, fc2: Tensor,
             bias1: Optional[Tensor], bias2: Optional[Tensor], num_experts: int, align: int,
             activation: str, glu_interleave: int, alpha: float, limit: float, offset: float
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """ids [T, K] (and probs [T, K] float32): x's tokens routed by a plan,
    permuted, through the MLP and summed home; ids None: x is one group of
    rows (probs None). Returns (out [T, H], the plan's two buffers, FC1's
    output h, the rows' probs)."""
    cfg = (activation, glu_interleave, alpha, limit, offset)
    s, dev = _stream(x), x.device
    T, H = x.shape
    if ids is None:
        plan64 = torch.arange(2, dtype=_i64, device=dev) * T
        plan32 = torch.empty(0, dtype=_i32, device=dev)
        offsets, real_rows, view = plan64, None, None
        rows, row_probs = x, probs
    else:
        K = ids.shape[1]
        cap, ws, p64, p32 = _plan_layout(T, K, num_experts, align)
        plan64 = torch.empty(sum(p64), dtype=_i64, device=dev)
        plan32 = torch.empty(sum(p32), dtype=_i32, device=dev)
        workspace = torch.empty(ws, dtype=torch.uint8, device=dev) if ws else None
        offsets, real_rows, view = _groups(ids, num_experts, align, plan64, plan32)
        _C.build_plan(ids.contiguous(), view, workspace, s)
        rows = x.new_empty(cap, H)
        row_probs = None if probs is None else torch.empty(cap, dtype=_f32, device=dev)
        _C.permute(x, view, rows, None if probs is None else probs.contiguous(), row_probs,
                   None, None, s)
    R = rows.shape[0]
    y = x.new_empty(R, fc2.shape[1])
    h = x.new_empty(R, fc1.shape[1])
    a = x.new_empty(R, fc2.shape[2])  # not kept: recomputed from h before the weight gradients
    _C.grouped_mlp_forward(rows, fc1, fc2, bias1, bias2, offsets, real_rows, row_probs, *cfg,
                           y, h, a, s)
    out = y
    if view is not None:
        out = x.new_empty(T, H)
        _C.unpermute(y, view, out, None, s)
    if row_probs is None:
        row_probs = torch.empty(0, dtype=_f32, device=dev)
    return out, plan64, plan32, h, row_probs


@_experts.register_fake
def _(x, ids, probs, fc1, fc2, bias1, bias2, num_experts, align, activation, glu_interleave,
      alpha, limit, offset):
    T, H = x.shape
    if ids is None:
        rows, n64, n32 = T, 2, 0
    else:
        rows, _, p64, p32 = _plan_layout(T, ids.shape[1], num_experts, align)
        n64, n32 = sum(p64), sum(p32)
    return (x.new_empty((T, H)), x.new_empty((n64,), dtype=_i64), x.new_empty((n32,), dtype=_i32),
            x.new_empty((rows, fc1.shape[1])),
            x.new_empty((rows if probs is not None else 0,), dtype=_f32))


# The backward in two operators, in the eager node's order: FC2's side reads
# h for the last time, so that a compiled backward frees it (a graph input
# past its last use) before dx and FC1's weight gradient are allocated, as
# the eager node drops it.
@torch.library.custom_op("moeflow::experts_backward_fc2", mutates_args=())
def _experts_backward_fc2(dout: Tensor, ids: Optional[Tensor], probs: Optional[Tensor],
                          fc1: Tensor, fc2: Tensor, bias1: Optional[Tensor],
                          bias2: Optional[Tensor], plan64: Tensor, plan32: Tensor, h: Tensor,
                          row_probs: Tensor, num_experts: int, align: int, activation: str,
                          glu_interleave: int, alpha: float, limit: float, offset: float
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_h, the rows' probs' gradient, dfc2, dbias2): the unpermute's
    backward, FC2's dgrad with the activation's backward, FC2's weight
    gradient on the recomputed activation. Empty tensors stand for absent
    ones."""
    cfg = (activation, glu_interleave, alpha, limit, offset)
    s, dev = _stream(h), h.device
    offsets, real_rows, view = _groups(ids, num_experts, align, plan64, plan32)
    R, H = h.shape[0], fc2.shape[1]
    rp = row_probs if probs is not None else None
    if view is not None:
        dy = dout.new_empty(R, H)
        _C.unpermute_backward(dout.contiguous(), view, None, None, dy, None, s)
    else:
        dy = dout.contiguous()
    d_h = h.new_empty(h.shape)
    d_rp = torch.empty(R if rp is not None else 0, dtype=_f32, device=dev)
    _C.grouped_mlp_backward_dgrad(dy, fc1, fc2, bias1, bias2, offsets, real_rows, rp, *cfg, h,
                                  None, d_h, None if rp is None else d_rp, s)
    a = d_h.new_empty(R, fc2.shape[2])
    _C.grouped_mlp_recompute_activation(h, offsets, real_rows, rp, *cfg, a, s)
    g2 = fc2.new_empty(fc2.shape)
    db2 = None if bias2 is None else torch.empty(bias2.shape, dtype=_f32, device=dev)
    _C.grouped_mlp_backward_wgrad(dy, None, offsets, real_rows, None, a, None, None, g2, None, db2,
                                  False, s)
    return d_h, d_rp, g2, _bias_grad(db2, bias2, h)


def _bias_grad(db, b, like):
    return like.new_empty(0) if db is None else db.to(b.dtype)


@_experts_backward_fc2.register_fake
def _(dout, ids, probs, fc1, fc2, bias1, bias2, plan64, plan32, h, row_probs, *cfg):
    return (h.new_empty(h.shape), h.new_empty((h.shape[0] if probs is not None else 0,),
                                              dtype=_f32),
            fc2.new_empty(fc2.shape),
            h.new_empty((0,)) if bias2 is None else bias2.new_empty(bias2.shape))


@torch.library.custom_op("moeflow::experts_backward_fc1", mutates_args=())
def _experts_backward_fc1(d_h: Tensor, d_row_probs: Tensor, x: Tensor, ids: Optional[Tensor],
                          probs: Optional[Tensor], fc1: Tensor, fc2: Tensor,
                          bias1: Optional[Tensor], plan64: Tensor, plan32: Tensor,
                          num_experts: int, align: int, activation: str, glu_interleave: int,
                          alpha: float, limit: float, offset: float
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dprobs, dfc1, dbias1): FC1's dgrad and the permute's backward,
    then FC1's weight gradient on the tokens permuted again."""
    cfg = (activation, glu_interleave, alpha, limit, offset)
    s, dev = _stream(d_h), d_h.device
    offsets, real_rows, view = _groups(ids, num_experts, align, plan64, plan32)
    R = d_h.shape[0]
    d_rp = d_row_probs if probs is not None else None
    dx_rows = d_h.new_empty(R, fc1.shape[2])
    _C.grouped_mlp_backward_fc1_dgrad(d_h, fc1, fc2, offsets, real_rows, *cfg, dx_rows, s)
    dprobs = torch.empty(0, dtype=_f32, device=dev)
    if view is not None:
        dx = x.new_empty(x.shape)
        if d_rp is not None:
            dprobs = torch.empty(ids.shape, dtype=_f32, device=dev)
        _C.permute_backward(dx_rows, view, dx, d_rp, None if d_rp is None else dprobs, s)
        del dx_rows
        x_rows = x.new_empty(R, x.shape[1])
        _C.permute(x, view, x_rows, None, None, None, None, s)
    else:
        dx, x_rows = dx_rows, x
    g1 = fc1.new_empty(fc1.shape)
    db1 = None if bias1 is None else torch.empty(bias1.shape, dtype=_f32, device=dev)
    _C.grouped_mlp_backward_wgrad(None, x_rows, offsets, real_rows, None, None, d_h, g1, None, db1,
                                  None, False, s)
    return dx, dprobs, g1, _bias_grad(db1, bias1, d_h)


@_experts_backward_fc1.register_fake
def _(d_h, d_row_probs, x, ids, probs, fc1, fc2, bias1, plan64, plan32, *cfg):
    dprobs = (d_h.new_empty(tuple(ids.shape), dtype=_f32) if ids is not None and probs is not None
              else d_h.new_empty((0,), dtype=_f32))
    return (x.new_empty(x.shape), dprobs, fc1.new_empty(fc1.shape),
            d_h.new_empty((0,)) if bias1 is None else bias1.new_empty(bias1.shape))


def _experts_setup(ctx, inputs, output):
    x, ids, probs, fc1, fc2, bias1, bias2 = inputs[:7]
    _, plan64, plan32, h, row_probs = output
    ctx.save_for_backward(x, ids, probs, fc1, fc2, bias1, bias2, plan64, plan32, h, row_probs)
    ctx.cfg = inputs[7:]


def _experts_grad(ctx, dout, *unused):
    x, ids, probs, fc1, fc2, bias1, bias2, plan64, plan32, h, row_probs = ctx.saved_tensors
    d_h, d_rp, g2, gb2 = _experts_backward_fc2(dout, ids, probs, fc1, fc2, bias1, bias2, plan64,
                                               plan32, h, row_probs, *ctx.cfg)
    del h, row_probs
    dx, dprobs, g1, gb1 = _experts_backward_fc1(d_h, d_rp, x, ids, probs, fc1, fc2, bias1, plan64,
                                                plan32, *ctx.cfg)
    return (dx, None, None if probs is None else dprobs, g1, g2,
            None if bias1 is None else gb1, None if bias2 is None else gb2) + (None,) * 7


_experts.register_autograd(_experts_grad, setup_context=_experts_setup)


def experts(x: Tensor, ids: Optional[Tensor], probs: Optional[Tensor], fc1: Tensor, fc2: Tensor,
            bias1: Optional[Tensor], bias2: Optional[Tensor], num_experts: int, align: int,
            cfg: tuple) -> Tensor:
    """ops.grouped_mlp(x, ..., plan=Plan(ids, num_experts, align), probs=probs,
    permute=True, unpermute=True) [T, H]; ids None: ops.grouped_mlp on x as
    one group (offsets [0, T])."""
    return _experts(x.contiguous(), ids, probs, fc1, fc2, bias1, bias2, int(num_experts),
                    int(align), *cfg)[0]
