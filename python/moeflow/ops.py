"""moeflow's ops as torch autograd functions (needs torch).

    import moeflow.ops as mf
    r = mf.router(logits, 2, aux_loss_coeff=1e-2)            # Megatron-Core's top-k router
    plan = mf.Plan(r.topk_ids, num_experts=E, align=16)      # on the device, no sync
    xp, pp = mf.permute(x, plan, r.probs)                    # [capacity, H], [capacity]
    y = mf.grouped_mlp(xp, fc1, fc2, plan=plan, probs=pp)    # FC1 + SwiGLU + FC2
    out = mf.unpermute(y, plan)                              # [T, H]

Every op runs on torch's current CUDA stream (or on the CPU reference
backend for CPU tensors), allocates its outputs with torch (the caching
allocator: no cudaMalloc on the hot path) and never synchronises with the
host, so a whole MoE layer, forward and backward, can be captured in one
CUDA graph and replayed with new routing. Counts stay on the device:
reading ``plan.total_rows`` or ``plan.overflow`` on the host is the
caller's synchronisation.

Rows of the permuted buffer past ``plan.total_rows`` (the unused capacity)
are not written: their values, and their gradients, are undefined. The
grouped MLP reads and writes rows by the plan's expert offsets only.
"""
from __future__ import annotations

import atexit
import weakref
from operator import attrgetter as _attrgetter
from typing import Optional, Tuple

import torch

from . import _C, _mlp_io
from ._fp8_ops import (_FP8, dequantize, grouped_gemm_fp8_forward,  # noqa: F401
                       grouped_gemm_fp8_wgrad, quantize, quantize_group_rows,
                       quantize_rowwise_columnwise, requantize_columnwise,
                       transpose_codes)
from ._checkpoint import _GATED
from ._mlp_node import _GroupedMlp
from ._ops_common import (_empty, _float32, _grad_enabled, _int32, _int64,  # noqa: F401
                          _nodes, _plan_sizes, _rows, _stream, _uint8)
from ._router_ops import (RouterOutput, apply_capacity, router, router_logits,  # noqa: F401
                          update_expert_bias)

__all__ = [
    "RouterOutput", "router", "router_logits", "apply_capacity", "update_expert_bias",
    "quantize", "quantize_rowwise_columnwise", "dequantize", "requantize_columnwise",
    "transpose_codes", "Plan",
    "permute", "permute_quantize", "unpermute", "unpermute_backward_quantize", "grouped_mlp",
    "activation_quantize", "WgradStore"
]


class Plan:
    """The routing plan of one layer call, built on the device.

    ``topk_ids`` [T, K] int32 or int64 global expert ids (-1: no expert).
    Each expert's rows are padded to a multiple of ``align`` (1, 16, 32, 64,
    128 or 256; 16 for FP8). ``capacity_rows`` = -1 sizes the permuted
    buffer for the worst case (nothing dropped); a smaller multiple of
    ``align`` drops what does not fit and counts it in ``overflow``.

    Tensors (on topk_ids' device): tokens_per_expert [E] int32,
    padded_tokens_per_expert [E] int32, expert_row_offsets [E+1] int64,
    dest_row [T, K] int64 (-1: unrouted or dropped), row_token / row_k
    [capacity] int32, total_rows [1] int64, overflow [1] int32, invalid_ids
    [1] int32 (ids out of range, treated as unrouted).
    """

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, align: int = 1,
                 capacity_rows: int = -1, *, _mask: bool = False):
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
        T, K = topk_ids.shape
        E = int(num_experts)
        if _mask and K != E:
            raise ValueError(f"routing_mask must be [T, num_experts={E}], got {tuple(topk_ids.shape)}")
        align = int(align)
        self.num_tokens, self.topk, self.num_experts, self.align = T, K, E, align
        self._capacity_arg = capacity_rows
        # Two allocations holding the plan's tensors (every one of them is
        # written by the build: no zero fill needed); the C++ plan reads the
        # two buffers, the tensors are views made when first read.
        if _nodes is not None:  # one C++ call: allocate and build
            self._ref = ref = _nodes.build_plan(topk_ids, E, align, capacity_rows, _mask)
            self.capacity_rows = ref.capacity_rows
            self._buffers = (ref.buffer64, ref.buffer32)
            self._workspace = ref.workspace
            return
        ids = topk_ids.contiguous()
        dev = ids.device
        cap, ws, parts64, parts32 = _plan_sizes(T, K, E, align, capacity_rows)
        self.capacity_rows = cap
        b64 = _empty(sum(parts64), dtype=_int64, device=dev)
        b32 = _empty(sum(parts32), dtype=_int32, device=dev)
        self._buffers = (b64, b32)
        self._workspace = _empty(ws, dtype=_uint8, device=dev) if ws else None
        build = _C.build_plan_from_mask if _mask else _C.build_plan
        build(ids, self._view, self._workspace, _stream(ids))

    def __getattr__(self, name: str):
        # Reached only for an attribute not set: those made on first use.
        d = self.__dict__
        if "_buffers" in d:
            if name.startswith("_t_") and "_t_dest_row" not in d:  # views of the two buffers
                T, K = self.num_tokens, self.topk
                _, _, parts64, parts32 = _plan_sizes(T, K, self.num_experts, self.align,
                                                     self._capacity_arg)
                offs, dest, total = self._buffers[0].split_with_sizes(parts64)
                (self._t_tokens_per_expert, self._t_padded_tokens_per_expert, self._t_row_token,
                 self._t_row_k, self._t_overflow, self._t_invalid_ids) = \
                    self._buffers[1].split_with_sizes(parts32)
                self._t_expert_row_offsets, self._t_dest_row = offs, dest.view(T, K)
                self._t_total_rows = total
            elif name == "_plan_view":  # made on first use, and again after _release_plan_views
                self._plan_view = _C.PlanView.from_buffers(
                    self.num_tokens, self.topk, self.num_experts, self.align,
                    self._capacity_arg, *self._buffers)
                # Registered for _release_plan_views (the ref leaves the set with the plan).
                _live_plans.add(_weakref(self, _live_plans_discard))
            if name in d:
                return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Read-only; one C-level getter each (no Python frame once the views exist).
    expert_row_offsets = property(_attrgetter("_t_expert_row_offsets"))
    dest_row = property(_attrgetter("_t_dest_row"))
    total_rows = property(_attrgetter("_t_total_rows"))
    tokens_per_expert = property(_attrgetter("_t_tokens_per_expert"))
    padded_tokens_per_expert = property(_attrgetter("_t_padded_tokens_per_expert"))
    row_token = property(_attrgetter("_t_row_token"))
    row_k = property(_attrgetter("_t_row_k"))
    overflow = property(_attrgetter("_t_overflow"))
    invalid_ids = property(_attrgetter("_t_invalid_ids"))

    # The C++ RoutingPlan over this plan's tensors (_C.PlanView).
    _view = property(_attrgetter("_plan_view"))

    @classmethod
    def from_mask(cls, routing_mask: torch.Tensor, align: int = 1,
                  capacity_rows: int = -1) -> "Plan":
        """The plan of a [T, E] bool routing mask (Megatron's form): slot
        (t, k) is expert k, so [T, E] probs are this plan's [T, K] probs."""
        return cls(routing_mask, routing_mask.shape[-1], align, capacity_rows, _mask=True)


# The autograd nodes of the ops below keep their Plan (ctx.plan) for the
# backward. A tensor the program still holds at exit (a module-level `out`)
# keeps its graph, and torch frees a graph node's Python context only while
# the interpreter is initialised: at shutdown it leaks it on purpose, and the
# Plan's PlanView with it (nanobind then reports "leaked instances"). So the
# C++ views of the plans still alive are released here, at exit, while
# Python is intact; a plan used after that makes its view again.
_live_plans: "set[weakref.ref[Plan]]" = set()
_live_plans_discard = _live_plans.discard
_weakref = weakref.ref


@atexit.register
def _release_plan_views() -> None:
    for ref in _live_plans.copy():
        plan = ref()
        if plan is not None:
            plan.__dict__.pop("_plan_view", None)


class _Permute(torch.autograd.Function):
    # ctx None: called without autograd (permute's fast path).
    @staticmethod
    def forward(ctx, x, probs, plan, scales):
        cap = plan.capacity_rows
        y = x.new_empty(cap, x.shape[1])
        pp = ps = None
        if probs is not None:
            pp = _empty(cap, dtype=_float32, device=x.device)
            probs = probs.contiguous()
        if scales is not None:
            scales = scales.contiguous()
            ps = scales.new_empty((cap,) + tuple(scales.shape[1:]))
        _C.permute(_rows(x), plan._view, y, probs, pp, scales, ps, _stream(x))
        if ctx is not None:
            ctx.set_materialize_grads(False)
            ctx.plan, ctx.x_meta = plan, (x.shape, x.dtype, probs is not None)
            if ps is not None:
                ctx.mark_non_differentiable(ps)
        return (y, pp) if ps is None else (y, pp, ps)

    @staticmethod
    def backward(ctx, dy, dpp, dps=None):
        plan = ctx.plan
        if dy is None and dpp is None:
            return None, None, None, None
        x_shape, x_dtype, has_probs = ctx.x_meta
        dev = (dy if dy is not None else dpp).device
        if dy is None:
            dy = torch.zeros((plan.capacity_rows, x_shape[1]), dtype=x_dtype, device=dev)
        dx = dy.new_empty(*x_shape)
        dprobs = None
        if has_probs and ctx.needs_input_grad[1] and dpp is not None:
            dprobs = torch.empty((plan.num_tokens, plan.topk), dtype=torch.float32, device=dev)
        _C.permute_backward(_rows(dy), plan._view, dx,
                            dpp.contiguous() if dprobs is not None else None, dprobs,
                            _stream(dy))
        return dx, dprobs, None, None


def permute(x: torch.Tensor, plan: Plan, probs: Optional[torch.Tensor] = None,
            scales: Optional[torch.Tensor] = None):
    """x [T, H] -> (rows [capacity, H] expert-major and padded, pad rows zero;
    probs of every row [capacity] float32, 0 on pad rows, or None).
    probs: [T, K] float32 router probabilities of the slots (differentiable).
    x may be FP8 (torch.float8_e4m3fn / e5m2; no gradient then) with
    per-token ``scales`` [T, S] of any dtype (e.g. float32 1x128 block
    scales): they travel with the rows, and a third output, the rows'
    scales [capacity, S] (0 on pad rows), is returned."""
    if scales is None and _nodes is not None:
        return _nodes.permute(x, probs, plan._ref)
    if _grad_enabled() and (x.requires_grad or (probs is not None and probs.requires_grad)
                            or (scales is not None and scales.requires_grad)):
        return _Permute.apply(x, probs, plan, scales)
    return _Permute.forward(None, x, probs, plan, scales)


def permute_quantize(x: torch.Tensor, plan: Plan, probs: Optional[torch.Tensor] = None,
                     fp8_format: str = "e4m3", pow2_scales: bool = False,
                     scaling: str = "1x128", transposed: bool = False):
    """x [T, H] bf16/fp16/float32 -> (rows [capacity, H] fp8 expert-major and
    padded, with their 1x128 scales rows_scales [capacity, ceil(H/128)]
    float32; probs of every row [capacity] float32 or None): exactly
    ``quantize(x, fp8_format, "1x128")`` then :func:`permute` of the fp8 rows
    with their scales, with x read once (pad rows: code 0, scale 0). Returns
    (rows, row_probs, row_scales). ``scaling="tensorwise"``: exactly
    :func:`permute` then :func:`quantize_group_rows` over the plan's groups
    (one scale [1] from the kept slots' tokens; every row without a slot
    code 0), the tokens read once for the amax and once per slot for the
    codes; with ``transposed`` a fourth output, rows_t [H, capacity] (the
    codes transposed, the tensorwise wgrad's operand), from the same pass.
    ``transposed`` with ``scaling="1x128"``: a fourth and a fifth output,
    rows_t [H, capacity] and rows_t_scales [H, ceil(capacity/128)] (the
    transposed view of a contiguous [ceil(capacity/128), H]): exactly
    ``quantize(rows, fp8_format, "1x128", columnwise=True)`` of the 16-bit
    rows (pad rows zero), the blockwise wgrad's operand, in a second kernel
    that gathers the tokens without writing the rows; the 128-row blocks
    starting at or past the plan's total rows are left unwritten.
    Not differentiable (the FP8 forward input of the experts)."""
    x = _rows(x.detach())
    fp8 = _FP8.get(fp8_format, torch.float8_e4m3fn)
    y, scales, y_t = _fp8_rows_out(plan, x, fp8, scaling, transposed)
    pp = None
    if probs is not None:
        probs = probs.detach().contiguous()
        pp = torch.empty(plan.capacity_rows, dtype=torch.float32, device=x.device)
    _C.permute_quantize(x, plan._view, y, scales, fp8_format, bool(pow2_scales), probs, pp,
                        _stream(x), scaling, y_t)
    if transposed and scaling == "1x128":
        return (y, pp, scales) + _mlp_io.columnwise_codes(x, plan, fp8_format, pow2_scales)
    return (y, pp, scales, y_t) if transposed else (y, pp, scales)


def _fp8_rows_out(plan: Plan, x: torch.Tensor, fp8, scaling: str, transposed: bool):
    """The outputs of the permute_quantize ops: rows, scales and, for
    ``transposed``, the rows' codes transposed."""
    if scaling not in ("1x128", "tensorwise"):
        raise _C.Error(f"scaling must be '1x128' or 'tensorwise', got {scaling!r}")
    cap, H = plan.capacity_rows, x.shape[1]
    y = torch.empty((cap, H), dtype=fp8, device=x.device)
    scales = torch.empty((1,) if scaling == "tensorwise" else (cap, -(-H // 128)),
                         dtype=torch.float32, device=x.device)
    # (the blockwise transposed codes come with their own scales: _mlp_io.columnwise_codes)
    y_t = (torch.empty((H, cap), dtype=fp8, device=x.device)
           if transposed and scaling == "tensorwise" else None)
    return y, scales, y_t


def unpermute_backward_quantize(dout: torch.Tensor, plan: Plan,
                                probs: Optional[torch.Tensor] = None,
                                fp8_format: str = "e4m3", pow2_scales: bool = False,
                                scaling: str = "1x128", transposed: bool = False):
    """The gradient of :func:`unpermute` as FP8 rows for an FP8 FC2 dgrad:
    dout [T, H] bf16/fp16/float32 -> (dy [capacity, H] fp8 expert-major with
    its 1x128 scales dy_scales [capacity, ceil(H/128)] float32), exactly the
    rows unpermute's backward writes (each slot's w * dout, rounded to dout's
    dtype, with ``probs`` [T, K]) quantized rowwise, with dout read once. Pad
    rows: code 0, scale 1; rows past ``plan.total_rows`` are left as
    allocated. ``scaling="tensorwise"``: those rows quantized by
    :func:`quantize_group_rows` over the plan's groups (dy_scales [1]; every
    row without a slot code 0), with ``transposed`` a third output dy_t [H,
    capacity] from the same pass. Not differentiable; the probs' gradient
    needs the forward rows (unpermute's own backward)."""
    if transposed and scaling != "tensorwise":
        raise _C.Error("transposed=True needs scaling='tensorwise'")
    dout = _rows(dout.detach())
    fp8 = _FP8.get(fp8_format, torch.float8_e4m3fn)
    dy, scales, dy_t = _fp8_rows_out(plan, dout, fp8, scaling, transposed)
    _C.unpermute_backward_quantize(dout, plan._view,
                                   None if probs is None else probs.detach().contiguous(), dy,
                                   scales, fp8_format, bool(pow2_scales), _stream(dout), scaling,
                                   dy_t)
    return (dy, scales, dy_t) if transposed else (dy, scales)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, probs, plan):  # ctx None: called without autograd (unpermute's fast path)
        out = y.new_empty(plan.num_tokens, y.shape[1])
        y = _rows(y)
        if probs is not None:
            probs = probs.contiguous()
        _C.unpermute(y, plan._view, out, probs, _stream(y))
        if ctx is not None:
            ctx.plan, ctx.y_meta = plan, (y.shape, y.dtype)
            # The backward reads y only for the probs' gradient.
            ctx.save_for_backward(y if ctx.needs_input_grad[1] else None, probs)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan = ctx.plan
        y, probs = ctx.saved_tensors
        shape, dtype = ctx.y_meta
        dy = dout.new_empty(*shape, dtype=dtype)
        dprobs = None
        if y is not None:
            dprobs = torch.empty((plan.num_tokens, plan.topk), dtype=torch.float32,
                                 device=dout.device)
        _C.unpermute_backward(_rows(dout), plan._view, y, probs, dy, dprobs, _stream(dout))
        return dy, dprobs, None


def unpermute(y: torch.Tensor, plan: Plan,
              probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rows [capacity, H] -> out [T, H]: each token's rows summed in float32
    in a fixed order (bitwise deterministic), weighted by probs [T, K] float32
    when given (differentiable), written in y's dtype."""
    if _nodes is not None:
        return _nodes.unpermute(y, probs, plan._ref)
    if _grad_enabled() and (y.requires_grad or (probs is not None and probs.requires_grad)):
        return _Unpermute.apply(y, probs, plan)
    return _Unpermute.forward(None, y, probs, plan)


def clear_fp8_weight_cache(*weights: torch.Tensor) -> None:
    """Drops the FP8 codes ``grouped_mlp(..., fp8_weight_cache=True)`` keeps
    on these weights: needed after updating them without bumping their
    version counter (through ``.data`` or by writing their storage)."""
    from . import _fp8_mlp
    _fp8_mlp.clear_weight_cache(*weights)


class WgradStore:
    """Holds the weight-gradient GEMMs of grouped_mlp backward calls for
    later (delayed wgrad, as TransformerEngine's ``delay_wgrad_compute``):
    give it to :func:`grouped_mlp` as ``wgrad_store``; the backward then
    computes the input gradients only and queues the weight gradients, and
    :meth:`run` computes them (in call order), adding them into the weights'
    ``.grad`` (or ``main_grad``). The queued work keeps its inputs alive
    until it runs."""

    def __init__(self):
        self._pending = []

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work()


def activation_quantize(h: torch.Tensor, *, plan: Optional[Plan] = None,
                        offsets: Optional[torch.Tensor] = None,
                        real_rows: Optional[torch.Tensor] = None,
                        probs: Optional[torch.Tensor] = None, activation: str = "swiglu",
                        glu_interleave: int = 0, alpha: float = 1.702, limit: float = 7.0,
                        offset: float = 1.0, fp8_format: str = "e4m3",
                        pow2_scales: bool = False, scaling: str = "1x128",
                        transposed: bool = False) -> Tuple:
    """FC2's input of the grouped MLP as FP8: a = act(h) * p in h's dtype (as
    :func:`grouped_mlp` computes it from FC1's output h [rows, N1]), quantized
    1x128 rowwise, with h read once. Returns (a_q [rows, F] fp8, a_scales
    [rows, ceil(F/128)] float32); pad rows: code 0, scale 1; rows past the
    groups are left as allocated. ``scaling="tensorwise"``: one scale
    (a_scales [1]) from the amax of a over the groups' real rows, every other
    row code 0 (h read twice); with ``transposed`` a third output, a_q_t [F,
    rows], the codes transposed, from the same pass (the tensorwise wgrad's
    operand). Groups and activation options as :func:`grouped_mlp`. Not
    differentiable."""
    if scaling not in ("1x128", "tensorwise"):
        raise ValueError(f"scaling must be '1x128' or 'tensorwise', got {scaling!r}")
    if transposed and scaling != "tensorwise":
        raise ValueError("transposed=True needs scaling='tensorwise'")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if plan is not None:
        offsets, real_rows = plan.expert_row_offsets, plan.tokens_per_expert
    if offsets is None:
        raise ValueError("activation_quantize needs plan= or offsets=")
    h = h.detach().contiguous()
    gated = activation in ("swiglu", "geglu", "clamped_quick_geglu")
    F = h.shape[1] // 2 if gated else h.shape[1]
    a_q = torch.empty((h.shape[0], F), dtype=_FP8.get(fp8_format, torch.float8_e4m3fn),
                      device=h.device)
    a_scales = torch.empty((h.shape[0], -(-F // 128)) if scaling == "1x128" else (1,),
                           dtype=torch.float32, device=h.device)
    a_q_t = torch.empty((F, h.shape[0]), dtype=a_q.dtype, device=h.device) if transposed else None
    _C.grouped_mlp_activation_quantize(h, offsets, real_rows,
                                       None if probs is None else probs.detach().contiguous(),
                                       activation, int(glu_interleave), float(alpha),
                                       float(limit), float(offset), fp8_format,
                                       bool(pow2_scales), a_q, a_scales, _stream(h), scaling,
                                       a_q_t)
    return (a_q, a_scales, a_q_t) if transposed else (a_q, a_scales)


_ACTIVATIONS = ("swiglu", "geglu", "clamped_quick_geglu", "gelu", "relu", "squared_relu")


def grouped_mlp(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, *,
                plan: Optional[Plan] = None, offsets: Optional[torch.Tensor] = None,
                real_rows: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None,
                bias1: Optional[torch.Tensor] = None, bias2: Optional[torch.Tensor] = None,
                activation: str = "swiglu", glu_interleave: int = 0, alpha: float = 1.702,
                limit: float = 7.0, offset: float = 1.0,
                accumulate_into_main_grad: bool = False, accumulate_into_grad: bool = True,
                recompute_activation: bool = True,
                wgrad_store: Optional[WgradStore] = None, unpermute: bool = False,
                permute: bool = False, recompute_permute: bool = True,
                precision: str = "bf16", fp8_weight_cache: bool = False,
                fp8_wgrad: bool = False, align: Optional[int] = None,
                _grad_params: Optional[Tuple] = None, _ep=None) -> torch.Tensor:
    """The grouped expert MLP: for the rows of each expert e,
    h = x W1_e^T + b1_e, a = act(h) * p, y = a W2_e^T + b2_e.

    x [rows, H] bf16/fp16; fc1 [E, N1, H] (N1 = 2F for GLU activations,
    gate rows then up rows, or blocks of ``glu_interleave``); fc2 [E, H, F];
    bias1 [E, N1], bias2 [E, H] optional; probs [rows] float32 optional (the
    permuted router probabilities: applied after the activation). The groups:
    ``plan`` (its expert offsets and real rows), or ``offsets`` [E+1] int64
    (+ optional ``real_rows`` [E] int32). Pad rows give zeros and get no
    gradient.

    Weight gradients: accumulated in float32 and written in the weights'
    dtype by the wgrad GEMM (no float32 copy); with
    ``accumulate_into_main_grad`` they are added instead into
    ``fc1.main_grad`` and ``fc2.main_grad`` (float32, the weights' shapes:
    Megatron's gradient-accumulation fusion) and fc1 / fc2 get no ``.grad``.
    ``accumulate_into_grad`` (default): where ``.backward()`` would add a
    weight gradient into an existing ``.grad`` (gradient accumulation over
    micro-batches), the wgrad GEMM adds it in place (the gradient rounded to
    the weight's dtype, then added and rounded: autograd's own arithmetic,
    by a TMA reduce-add) and no new gradient is
    allocated or added by autograd; not under ``autograd.grad`` or
    ``create_graph``, with tensor or post-accumulate hooks on the weight, for
    a ``.grad`` of another dtype or layout or not 16-byte aligned, or off
    the default CUDA stream (then the gradient is returned as usual).
    Pre-hooks on the weight's AccumulateGrad node then see no incoming
    gradient, and what they would change of it is lost (its post hooks see
    the updated ``.grad``; docs/python.md). Not with ``wgrad_store``.
    ``recompute_activation`` (default): only the FC1 output h is kept for
    backward; a = act(h) * p is recomputed just before the weight gradients.
    ``wgrad_store``: delay the weight gradients (see :class:`WgradStore`).
    ``unpermute`` (needs ``plan``): returns ``unpermute(y, plan)`` [T, H]
    instead of y, in the same autograd node, so that backward frees the
    rows' gradient as soon as FC2's weight gradient has read it (a lower
    peak than the two ops chained). ``permute`` (needs ``plan``): x is the
    tokens [T, H] and probs their slots' [T, K] probs,
    permuted by the plan in the same node (``permute(x, plan, probs)``
    first), so that backward frees the rows' input gradient once the tokens'
    exists, before FC1's weight gradient is allocated; x's and probs'
    gradients are the tokens' and the [T, K] probs'. ``recompute_permute``
    (default, with ``permute``): the node keeps the tokens for FC1's weight
    gradient, not the rows, and permutes them again just before it (one
    permute more in backward; the rows, K times the tokens' bytes, do not
    live from forward to backward; the tokens must then stay unchanged until
    backward, as any saved input).

    ``precision``: "bf16" (the 16-bit GEMMs above), or "fp8-blockwise" /
    "fp8-tensorwise": the forward and both input gradients through the FP8
    grouped GEMM (e4m3; 1x128 activation and 128 x 128 weight scales, or one
    scale per tensor), the weight gradients in 16 bits (docs/fp8.md,
    "Precision recipes"); ``fp8_wgrad``: the weight gradients too, through
    ``grouped_gemm_fp8_wgrad`` on x, dY, a and d(h) quantized along the rows:
    fp8-blockwise in 1x128 blocks of 128 rows, which needs each expert's rows
    to start at a multiple of 128 (a plan with ``align`` a multiple of 128,
    or with ``offsets=`` the ``align`` they were made with); fp8-tensorwise
    with the rowwise codes transposed (one scale), each expert's rows
    starting at a multiple of 16 (the FP8 default align). The rows must be a
    multiple of 16.
    The columnwise codes replace x in the saved tensors (tensorwise: a's
    codes from FC2's forward are kept too, rows x F bytes); pad rows should be
    zero, as permute and dispatch write them (their values enter the scales).
    FP8 needs bfloat16 x and weights, H, N1 and F multiples of 128, no biases
    and no wgrad_store. ``fp8_weight_cache``:
    keep the weights' FP8 codes (both orientations, 2 bytes per weight
    element) on the weights while they are unchanged (same storage and
    version counter), so that micro-batches between optimizer steps, and the
    backward after its forward, do not quantize them again. Updates that do
    not bump the version (writes through ``.data``, optimizers writing the
    storage directly) must call ``moeflow.ops.clear_fp8_weight_cache(w)``.
    Ignored while a CUDA graph is captured (the graph quantizes, so that
    replays follow the weights)."""
    # _ep (moeflow.MoELayer with an ep_group, bf16): dispatch's checked
    # arguments (ids, probs, scales, handle); x is this rank's tokens, probs
    # the dispatch's [T, K] probs, and the node dispatches, runs the MLP on
    # the received rows and combines them home (one node, as permute=True,
    # unpermute=True).
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if plan is not None:
        if offsets is not None or real_rows is not None:
            raise ValueError("give plan or offsets (+ real_rows), not both")
        offsets, real_rows = plan.expert_row_offsets, plan.tokens_per_expert
    if offsets is None and _ep is None:
        raise ValueError("grouped_mlp needs plan= or offsets=")
    cfg = (activation, int(glu_interleave), float(alpha), float(limit), float(offset))
    main = None
    if accumulate_into_main_grad:
        for name, w in (("fc1", fc1), ("fc2", fc2)):
            g = getattr(w, "main_grad", None)
            if g is None or g.dtype != torch.float32 or g.shape != w.shape:
                raise ValueError(f"accumulate_into_main_grad: {name}.main_grad must be a float32 "
                                 f"tensor of shape {tuple(w.shape)}, got "
                                 f"{None if g is None else (g.dtype, tuple(g.shape))}")
        main = (fc1.main_grad, fc2.main_grad)
    if unpermute and plan is None:
        raise ValueError("unpermute=True needs plan= (the plan to unpermute the rows with)")
    if permute:
        if plan is None:
            raise ValueError("permute=True needs plan= (the plan to permute the tokens with)")
        if x.dim() != 2 or x.shape[0] != plan.num_tokens:
            raise ValueError(f"permute=True: x must be the plan's tokens [{plan.num_tokens}, H], "
                             f"got shape {tuple(x.shape)}")
        if probs is not None and tuple(probs.shape) != (plan.num_tokens, plan.topk):
            raise ValueError(f"permute=True: probs must be [{plan.num_tokens}, {plan.topk}] "
                             f"(the slots' probs), got shape {tuple(probs.shape)}")
    if fp8_wgrad:
        if precision not in ("fp8-blockwise", "fp8-tensorwise"):
            raise ValueError(f"fp8_wgrad=True needs an FP8 precision, got {precision!r}")
        # the experts' rows
        rows = plan.capacity_rows if permute else \
            _ep[3].group.capacity_rows if _ep is not None else x.shape[0]
        if int(rows) % 16:
            raise ValueError(f"fp8_wgrad=True needs the rows to be a multiple of 16 (the "
                             f"transposed codes' rows), got {int(rows)}")
        got = plan.align if plan is not None else _ep[3].group.align if _ep is not None else align
        # blockwise: whole 128-row scale blocks; tensorwise: the FP8 align of 16
        need_align = 128 if precision == "fp8-blockwise" else 16
        if got is None or int(got) % need_align:
            raise ValueError(f"fp8_wgrad=True ({precision}) needs each expert's rows to start at "
                             f"a multiple of {need_align}: " +
                             (f"a plan with align a multiple of {need_align}, got align {got}"
                              if plan is not None else
                              f"with offsets=, align= a multiple of {need_align}, got {got}"))
    if precision != "bf16":
        from . import _fp8_mlp
        _fp8_mlp.check(x, fc1, fc2, bias1, bias2, precision, wgrad_store, activation)
        if _ep is not None:  # an FP8 group: the node dispatches the tokens' codes
            if _ep[3].group.dtype not in (torch.float8_e4m3fn,) or precision != "fp8-blockwise":
                raise ValueError("grouped_mlp with an expert-parallel source in FP8 needs "
                                 "precision='fp8-blockwise' and an e4m3 group")
            source = _mlp_io.QuantizedDispatchSource(_ep)
        else:
            source = _mlp_io.PermuteSource(plan, bool(recompute_permute)) if permute else None
        args = (offsets, real_rows, cfg, precision, main, plan if unpermute else None,
                bool(fp8_weight_cache), bool(fp8_wgrad), source, bool(accumulate_into_grad))
        if not (_grad_enabled() and (x.requires_grad or fc1.requires_grad or fc2.requires_grad
                                     or (probs is not None and probs.requires_grad))):
            return _fp8_mlp.GroupedMlpFp8.forward(None, x, fc1, fc2, probs, args)
        return _fp8_mlp.GroupedMlpFp8.apply(x, fc1, fc2, probs, args)
    _check_mlp_shapes(x, fc1, fc2, activation, plan, offsets, probs, permute, _ep is not None)
    if not (_grad_enabled() and (x.requires_grad or fc1.requires_grad or fc2.requires_grad
                                 or (bias1 is not None and bias1.requires_grad)
                                 or (bias2 is not None and bias2.requires_grad)
                                 or (probs is not None and probs.requires_grad))):
        return _GroupedMlp.forward(None, x, fc1, fc2, bias1, bias2, probs, (
            offsets, real_rows, cfg, (None, True, None, None) + _io(plan, permute, unpermute,
                                                                     _ep) + (False,)))
    params = _grad_params if _grad_params is not None else (fc1, fc2, bias1, bias2)
    opts = (main, bool(recompute_activation), wgrad_store, params) + _io(
        plan, permute, unpermute, _ep, recompute_permute) + (
        bool(accumulate_into_grad) and _grad_params is None,)
    return _GroupedMlp.apply(x, fc1, fc2, bias1, bias2, probs, (offsets, real_rows, cfg, opts))


def _check_mlp_shapes(x, fc1, fc2, activation, plan, offsets, probs, permute, ep):
    """The 16-bit path's weights against each other, x and the groups, each
    named (before the C++ checks, which name the library's parameters; the
    FP8 recipes check theirs in _fp8_mlp.check)."""
    if fc1.dim() != 3 or fc2.dim() != 3:
        raise ValueError(f"fc1 and fc2 must be [E, N1, H] and [E, H, F], got shapes "
                         f"{tuple(fc1.shape)} and {tuple(fc2.shape)}")
    E, N1, H = fc1.shape
    F = fc2.shape[2]
    gated = activation in _GATED
    if fc2.shape[0] != E or fc2.shape[1] != H or N1 != (2 * F if gated else F):
        raise ValueError(f"fc2 must be [E, H, F] matching fc1 [E, {'2F' if gated else 'F'}, H] "
                         f"({activation}): got fc1 {tuple(fc1.shape)}, fc2 {tuple(fc2.shape)}")
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x must be [rows, H={H}] (fc1's H), got shape {tuple(x.shape)}")
    if ep:
        return
    groups = plan.num_experts if plan is not None else \
        offsets.shape[0] - 1 if offsets is not None and offsets.dim() == 1 else None
    if groups is not None and groups != E:
        raise ValueError(f"fc1 and fc2 must hold one weight per group: {groups} "
                         f"({'the plan' if plan is not None else 'offsets'}), got E={E}")
    if plan is not None and not permute:
        if x.shape[0] != plan.capacity_rows:
            raise ValueError(f"x must be the plan's rows [capacity_rows={plan.capacity_rows}, "
                             f"H] (permute's output), got shape {tuple(x.shape)}")
        if probs is not None and tuple(probs.shape) != (plan.capacity_rows,):
            raise ValueError(f"probs must be the rows' probs [capacity_rows="
                             f"{plan.capacity_rows}] (permute's), got shape "
                             f"{tuple(probs.shape)}")


def _io(plan, permute, unpermute, ep, recompute_permute=False):
    """(the rows' source, the output's sink) of a grouped_mlp node."""
    if ep is not None:
        return _mlp_io.DispatchSource(ep), _mlp_io.CombineSink(ep[3])
    return (_mlp_io.PermuteSource(plan, bool(recompute_permute)) if permute else None,
            _mlp_io.UnpermuteSink(plan) if unpermute else None)
