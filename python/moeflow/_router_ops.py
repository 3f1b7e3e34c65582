"""The router ops of moeflow.ops (re-exported there): router, router_logits,
apply_capacity, update_expert_bias."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import _C
from ._ops_common import (_empty, _grad_enabled, _int32, _nodes, _router_ws_bytes, _stream,
                          _tuple_new, _uint8)


class RouterOutput(NamedTuple):
    """What :func:`router` returns, on the logits' device."""
    topk_ids: torch.Tensor  # [T, K] int32: the chosen experts, best first (-1: padding token)
    probs: torch.Tensor  # [T, K] float32: their routing probabilities (differentiable)
    tokens_per_expert: torch.Tensor  # [E] int32: slots routed to each expert
    aux_loss: Optional[torch.Tensor]  # 0-dim float32 (differentiable); None: coefficient 0
    z_loss: Optional[torch.Tensor]  # 0-dim float32 (differentiable); None: coefficient 0
    seq_aux_loss: Optional[torch.Tensor] = None  # 0-dim float32; None: coefficient 0
    nonfinite: Optional[torch.Tensor] = None  # [1] int32: tokens with a NaN / inf logit


class _Router(torch.autograd.Function):
    # args: (expert_bias, padding_mask, cu_seqlens, cfg, nd), none of them
    # differentiable. cfg: the RouterConfig fields in _C's order (num_experts,
    # topk, score_function, pre_softmax, num_groups, group_topk,
    # topk_scaling_factor, aux_loss_coeff, z_loss_coeff, seq_aux_loss_coeff).
    # The node's outputs: probs, or (probs, aux, z, seq) with any loss on;
    # the non-differentiable ones (ids, counts, nonfinite) are appended to the
    # list nd instead (apply() costs per input and per output).
    # ctx None: called without autograd (router's fast path).
    @staticmethod
    def forward(ctx, logits, args):
        expert_bias, padding_mask, cu_seqlens, cfg, nd = args
        E, K = cfg[0], cfg[1]
        logits = logits.contiguous()
        # float32, or float64 on the CPU (for gradient checks): the probs and
        # losses in the logits' dtype.
        T, dev, f32 = logits.shape[0], logits.device, logits.dtype
        ids = _empty(T, K, dtype=_int32, device=dev)
        probs = _empty(T, K, dtype=f32, device=dev)
        # The small int32 outputs share one allocation: counts [E], nonfinite [1].
        tpe, nonfinite = _empty(E + 1, dtype=_int32, device=dev).split_with_sizes((E, 1))
        aux = z = seq = seq_tpe = ws = None
        S = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 0
        losses = cfg[7] != 0 or cfg[8] != 0 or cfg[9] != 0
        if losses:
            aux = _empty((), dtype=f32, device=dev) if cfg[7] != 0 else None
            z = _empty((), dtype=f32, device=dev) if cfg[8] != 0 else None
            if cfg[9] != 0:
                seq = _empty((), dtype=f32, device=dev)
                seq_tpe = _empty(S, E, dtype=_int32, device=dev)
        if logits.is_cuda:
            ws_bytes = _router_ws_bytes(T, *cfg, S)
            ws = _empty(ws_bytes, dtype=_uint8, device=dev) if ws_bytes else None
        _C.router_forward(logits, *cfg, ids, probs, tpe, None if aux is None else aux.view(1),
                          None if z is None else z.view(1), None if seq is None else seq.view(1),
                          seq_tpe, nonfinite, None, expert_bias, padding_mask, cu_seqlens, ws,
                          _stream(logits))
        nd += (ids, tpe, nonfinite)
        if ctx is not None:
            ctx.set_materialize_grads(False)
            ctx.cfg = cfg
            # The backward reads the logits, the choice, the counts (losses)
            # and the token structure.
            ctx.save_for_backward(logits, ids, tpe if losses else None, padding_mask,
                                  None if seq is None else cu_seqlens, seq_tpe)
        return (probs, aux, z, seq) if losses else probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dprobs, daux=None, dz=None, dseq=None):
        if not ctx.needs_input_grad[0] or (dprobs is None and daux is None and dz is None
                                           and dseq is None):
            return None, None
        logits, ids, tpe, mask, cu_seqlens, seq_tpe = ctx.saved_tensors
        if dprobs is None:
            dprobs = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device)
        dlogits = torch.empty_like(logits)

        def one(g):
            return None if g is None else g.reshape(1).contiguous()

        _C.router_backward(logits, ids, tpe, *ctx.cfg, dprobs.contiguous(), one(daux), one(dz),
                           one(dseq), mask, cu_seqlens, seq_tpe, dlogits, _stream(logits))
        return dlogits, None


def router(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
           pre_softmax: bool = False, num_groups: Optional[int] = 0,
           group_topk: Optional[int] = 0, topk_scaling_factor: Optional[float] = None,
           expert_bias: Optional[torch.Tensor] = None, aux_loss_coeff: float = 0.0,
           z_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0,
           padding_mask: Optional[torch.Tensor] = None,
           cu_seqlens: Optional[torch.Tensor] = None) -> RouterOutput:
    """Megatron-Core's top-k router on float32 logits [T, E] (float64 on the
    CPU too, for gradient checks: probs and losses then float64; the gating
    GEMM is the caller's: :func:`router_logits`):
    ``topk_routing_with_score_function`` with the switch load-balancing
    loss, the per-sequence one and the z-loss, one fused op forward and
    backward (moeflow/router.h has the formulas).

    score_function "softmax" (``pre_softmax``: top-k of softmax over all E,
    else softmax over the k chosen logits) or "sigmoid" (probs renormalised
    over the k chosen when topk > 1; ``expert_bias`` [E] float32, added to
    the scores for the choice only: aux-loss-free balancing).
    ``num_groups`` / ``group_topk``: group-limited routing (0 or None: off).
    ``topk_scaling_factor`` multiplies the probs (None: 1). Ties choose the
    lower expert id.

    ``padding_mask`` [T] bool (True: a padding token): padding tokens are not
    routed (ids -1, probs 0), not counted, and kept out of every loss.
    ``seq_aux_loss_coeff`` > 0 (Megatron's "seq_aux_loss"): the aux loss of
    each sequence, averaged over the sequences ``cu_seqlens`` [S+1] int32
    gives (packed: sequence s is tokens cu_seqlens[s] .. cu_seqlens[s+1]-1;
    the values stay on the device).

    Non-finite logits (moeflow/router.h): a NaN logit counts as -inf (never
    chosen, gradient 0); +-inf are used as they are. ``nonfinite`` counts
    the tokens with any non-finite logit, on the device (read it to check).

    Returns a :class:`RouterOutput`. probs and the losses carry the
    gradient to ``logits`` (the choice held fixed; the counts constants, as
    in Megatron). Runs on torch's current stream; no host synchronisation
    (a step can be captured in a CUDA graph).
    """
    if logits.dim() != 2:
        raise _C.Error(f"logits must be float32 [T, E], got {str(logits.dtype)[6:]} "
                       f"shape {tuple(logits.shape)}")
    if seq_aux_loss_coeff and cu_seqlens is None:
        raise _C.Error("seq_aux_loss_coeff needs cu_seqlens ([S+1] int32, the sequences)")
    if _nodes is not None:  # the node in C++ (moeflow._autograd)
        return _tuple_new(RouterOutput, _nodes.router(
            logits, int(topk), str(score_function), bool(pre_softmax), int(num_groups or 0),
            int(group_topk or 0), 1.0 if topk_scaling_factor is None else float(topk_scaling_factor),
            float(aux_loss_coeff), float(z_loss_coeff), float(seq_aux_loss_coeff), expert_bias,
            padding_mask, cu_seqlens))
    cfg = (int(logits.shape[1]), int(topk), str(score_function), bool(pre_softmax),
           int(num_groups or 0), int(group_topk or 0),
           1.0 if topk_scaling_factor is None else float(topk_scaling_factor),
           float(aux_loss_coeff), float(z_loss_coeff), float(seq_aux_loss_coeff))
    bias = None if expert_bias is None else expert_bias.detach().contiguous()
    mask = None if padding_mask is None else padding_mask.detach().contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.detach().contiguous()
    nd = []  # ids, tokens_per_expert, nonfinite
    args = (bias, mask, cu, cfg, nd)
    if logits.requires_grad and _grad_enabled():
        out = _Router.apply(logits, args)
    else:
        out = _Router.forward(None, logits, args)
    if cfg[7] != 0 or cfg[8] != 0 or cfg[9] != 0:
        probs, aux, z, seq = out
    else:
        probs, aux, z, seq = out, None, None, None
    return _tuple_new(RouterOutput, (nd[0], probs, nd[1], aux, z, seq, nd[2]))


def apply_capacity(topk_ids: torch.Tensor, probs: Optional[torch.Tensor], num_experts: int,
                   capacity_factor: float, drop_policy: str = "probs",
                   min_capacity: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Expert capacity with token dropping (Megatron's
    moe_expert_capacity_factor / moe_token_drop_policy): each expert keeps
    at most C = max(ceil(T * K / E * capacity_factor), min_capacity) of its
    slots, those of highest prob ("probs") or the first in token order
    ("position"). Returns (kept_ids [T, K] int32, the ids with the dropped
    slots set to -1; dropped [1] int32, their number), on the device, no
    sync. Build the plan from kept_ids; the router's own backward keeps the
    original ids (a dropped slot's prob gets no gradient through the
    experts, as in Megatron)."""
    ids = topk_ids.contiguous()
    T, K = ids.shape
    kept = torch.empty_like(ids)
    dropped = torch.empty(1, dtype=torch.int32, device=ids.device)
    ws = None
    if ids.is_cuda:
        n = _C.router_capacity_workspace_bytes(T, K, int(num_experts))
        ws = torch.empty(n, dtype=torch.uint8, device=ids.device) if n else None
    _C.router_apply_capacity(ids, None if probs is None else probs.detach().contiguous(),
                             int(num_experts), float(capacity_factor), str(drop_policy),
                             int(min_capacity), kept, dropped, ws, _stream(ids))
    return kept, dropped


def _split_bf16(t: torch.Tensor, parts: str, along_columns: bool) -> torch.Tensor:
    """float32 t [R, C] as bf16 blocks, one per digit of ``parts``: part 0 =
    bf16(t), part 1 = bf16(t - part 0), part 2 = bf16(t - part 0 - part 1)
    (exact subtractions: the three parts' float32 sum is t for finite t),
    stacked along the rows ([n R, C]) or side by side ([R, n C]); one
    kernel (moeflow/router.h, router_split_bf16)."""
    R, C = t.shape
    n = len(parts)
    out = torch.empty((R, n * C) if along_columns else (n * R, C), dtype=torch.bfloat16,
                      device=t.device)
    _C.router_split_bf16(t, parts, along_columns, out, _stream(t))
    return out


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices into float32 (cuBLAS accumulates in float32 on
    the GPU; the CPU computes the same products in float32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _sum3(p: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The three blocks of n along dim (0 or 1) of a 2-D p summed (one
    reduction kernel)."""
    if dim == 1:
        return p.view(p.shape[0], 3, n).sum(1)
    return p.view(3, n, p.shape[1]).sum(0)


class _RouterLogits(torch.autograd.Function):
    """bf16 tokens: the float32 GEMMs as bf16 tensor-core GEMMs on the
    weight split into three bf16 parts (docs/python.md, "The router GEMM");
    other dtypes: float32 GEMMs on a float32 copy of x."""

    @staticmethod
    def forward(ctx, x, weight, split=True):
        ctx.save_for_backward(x, weight)  # x in its own dtype: no float32 copy kept
        ctx.split = split = split and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
        return _logits_forward(x, weight, split)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogits):
        x, weight = ctx.saved_tensors
        dx, dw = _logits_backward(dlogits, x, weight, ctx.split, *ctx.needs_input_grad[:2])
        return dx, dw, None


def _logits_forward(x: torch.Tensor, weight: torch.Tensor, split: bool) -> torch.Tensor:
    """The gating GEMM: through the weight's bf16 split (bf16 x), else float32."""
    if not split:
        return torch.nn.functional.linear(x.float(), weight)
    # The split is made again in backward (E x H, small) rather than kept.
    return _sum3(_mm_f32(x, _split_bf16(weight, "012", False).t()), weight.shape[0], 1)


def _logits_backward(dlogits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, split: bool,
                     want_dx: bool, want_dw: bool):
    """(dx, dw) of _logits_forward (None where not wanted)."""
    dx = dw = None
    if not split:
        if want_dx:
            dx = (dlogits @ weight).to(x.dtype)
        if want_dw:
            dw = dlogits.t() @ x.float()
        return dx, dw
    dlogits = dlogits.contiguous()
    if want_dx:
        # dx = d0 (w0 + w1 + w2) + d1 w0 in one bf16 GEMM over K = 4E,
        # float32 accumulation, rounded once to bf16 (what is left out,
        # d1 (w1 + w2) + d2 w, is below 2^-16 of the terms).
        w4 = _split_bf16(weight, "0120", False)
        a = _split_bf16(dlogits, "0001", True)
        dx = _mm_f32(a, w4).to(x.dtype) if not a.is_cuda else torch.mm(a, w4)
    if want_dw:
        dw = _sum3(_mm_f32(_split_bf16(dlogits, "012", True).t(), x), weight.shape[0], 0)
    return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gating GEMM in float32: x [T, H] (any float dtype) @ weight [E, H]
    float32 -> logits [T, E] float32, as ``linear(x.float(), weight)``, but
    keeping x in its own dtype for backward (no float32 copy of x is made).
    bf16 x runs on bf16 tensor cores with the weight (and in backward the
    logits' gradient) split into three exact bf16 parts: float32's accuracy
    (docs/python.md, "The router GEMM")."""
    _check_router_gemm(x, weight)
    return _RouterLogits.apply(x, weight.contiguous())


def _check_router_gemm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be floating-point [T, H], got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be float32 [E, H={x.shape[1]}] (one row per expert), "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")


def _router_logits_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """router_logits through float32 GEMMs on a float32 copy of x whatever
    x's dtype (the path of float16 / float32 tokens; benchmarks compare)."""
    _check_router_gemm(x, weight)
    return _RouterLogits.apply(x, weight.contiguous(), False)


def update_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                       rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step, in place on the device (no sync):
    ``expert_bias += rate * sign(mean(tokens_per_expert) - tokens_per_expert)``.
    tokens_per_expert [E] int32 (e.g. summed over the step's micro-batches);
    expert_bias [E] float32, contiguous. Returns expert_bias."""
    _C.router_update_expert_bias(tokens_per_expert.contiguous(), expert_bias, float(rate),
                                 _stream(expert_bias))
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:  # written outside torch: tell autograd it changed
        bump(expert_bias)
    return expert_bias
