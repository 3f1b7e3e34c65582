"""Where the grouped MLP's autograd node gets its rows and where it sends
its output (ops.grouped_mlp's permute= / unpermute=, and the
expert-parallel MoELayer's dispatch and combine): run inside the node, so
that its backward frees each rows' gradient as soon as it is read.

A source turns the node's input x (and its probs) into the experts' rows
and back: ``forward(x, probs) -> (rows, row_probs)``, ``backward(d_rows,
d_row_probs, want_dx) -> (dx, dprobs)``. A sink turns the MLP's output rows
into the node's output and back: ``forward(y, probs) -> (out, kept)``,
``backward(dout, probs, kept, rows_shape) -> (d_rows, dprobs)``; ``kept``
is saved with the node's tensors. ``collective``: its backward must run on
every rank (the node's backward then runs even without an output
gradient). One object per call (a source keeps x's shape)."""
from __future__ import annotations

import torch

from . import _C
from ._ops_common import _empty, _float32, _nodes, _stream


def columnwise_codes(x, plan, fp8_format="e4m3", pow2_scales=False):
    """The rows permute(x, plan) writes (pad rows zero) as the blockwise FP8
    wgrad's operand: codes [H, capacity] and 1x128 scales along the rows
    [H, capacity/128] (the transpose of a contiguous buffer), gathered from
    x without writing the rows (permute_quantize's columnwise form)."""
    cap, H = plan.capacity_rows, x.shape[1]
    fp8 = torch.float8_e5m2 if fp8_format == "e5m2" else torch.float8_e4m3fn
    q_t = torch.empty((H, cap), dtype=fp8, device=x.device)
    scales_t = _empty(-(-cap // 128), H, dtype=_float32, device=x.device).t()
    _C.permute_quantize(x, plan._view, q_t, scales_t, fp8_format, bool(pow2_scales), None, None,
                        _stream(x), "1x128", None, True)
    return q_t, scales_t


class PermuteSource:
    """x: the tokens [T, H]; probs: their slots' [T, K] (the rows carry them).
    ``recompute``: a node keeps the tokens, not the rows, for FC1's weight
    gradient and makes the rows again with :meth:`rows` (grouped_mlp's
    recompute_permute)."""
    collective = False

    def __init__(self, plan, recompute=False):
        self.plan = plan
        self.recompute = recompute

    def groups(self):
        return self.plan.expert_row_offsets, self.plan.tokens_per_expert

    def forward(self, x, probs):
        plan, cap = self.plan, self.plan.capacity_rows
        self.x_meta = (x.shape, x.dtype)
        if _nodes is not None:  # (inside the node's forward: grad off, no node recorded)
            return _nodes.permute(x, probs, plan._ref)
        rows = x.new_empty(cap, x.shape[1])
        row_probs = None if probs is None else _empty(cap, dtype=_float32, device=x.device)
        _C.permute(x, plan._view, rows, None if probs is None else probs.contiguous(), row_probs,
                   None, None, _stream(x))
        return rows, row_probs

    def rows(self, x):
        """forward's rows again from the same tokens (a gather: the same
        bits; pad rows zero)."""
        if _nodes is not None:
            return _nodes.permute(x, None, self.plan._ref)[0]
        rows = x.new_empty(self.plan.capacity_rows, x.shape[1])
        _C.permute(x, self.plan._view, rows, None, None, None, None, _stream(x))
        return rows

    def forward_blockwise(self, x, probs, transposed=False):
        """forward's rows as the fp8-blockwise recipe's e4m3 codes and 1x128
        scales (ops.permute_quantize: x read once, the bf16 rows never
        written). Returns (codes, scales [capacity, H/128], row_probs), and
        with ``transposed`` also (codes_t [H, capacity], scales_t [H,
        capacity/128]): the rows' columnwise codes, the FP8 wgrad's operand,
        from a second kernel that gathers the tokens."""
        plan, cap, H = self.plan, self.plan.capacity_rows, x.shape[1]
        self.x_meta = (x.shape, x.dtype)
        q = torch.empty((cap, H), dtype=torch.float8_e4m3fn, device=x.device)
        scales = _empty(cap, -(-H // 128), dtype=_float32, device=x.device)
        row_probs = None if probs is None else _empty(cap, dtype=_float32, device=x.device)
        _C.permute_quantize(x, plan._view, q, scales, "e4m3", False,
                            None if probs is None else probs.contiguous(), row_probs, _stream(x),
                            "1x128", None)
        if not transposed:
            return q, scales, row_probs
        return q, scales, row_probs, columnwise_codes(x, plan)

    def forward_tensorwise(self, x, probs, transposed):
        """forward's rows as the fp8-tensorwise recipe's e4m3 codes, with x
        read by the quantize (ops.permute_quantize, scaling "tensorwise"): the
        bf16 rows are never written. Returns (codes, scale [1], the codes
        transposed or None, row_probs)."""
        plan, cap, H = self.plan, self.plan.capacity_rows, x.shape[1]
        self.x_meta = (x.shape, x.dtype)
        fp8 = torch.float8_e4m3fn
        q = torch.empty((cap, H), dtype=fp8, device=x.device)
        scale = _empty(1, dtype=_float32, device=x.device)
        q_t = torch.empty((H, cap), dtype=fp8, device=x.device) if transposed else None
        row_probs = None if probs is None else _empty(cap, dtype=_float32, device=x.device)
        _C.permute_quantize(x, plan._view, q, scale, "e4m3", False,
                            None if probs is None else probs.contiguous(), row_probs, _stream(x),
                            "tensorwise", q_t)
        return q, scale, q_t, row_probs

    def backward(self, d_rows, d_row_probs, want_dx):
        plan = self.plan
        shape, dtype = self.x_meta
        if _nodes is not None and dtype == d_rows.dtype:
            dx, dprobs = _nodes.permute_backward(d_rows, d_row_probs, plan._ref)
            return (dx if want_dx else None), dprobs
        dx = d_rows.new_empty(shape, dtype=dtype)
        dprobs = None
        if d_row_probs is not None:
            dprobs = torch.empty((plan.num_tokens, plan.topk), dtype=torch.float32,
                                 device=d_rows.device)
        _C.permute_backward(d_rows, plan._view, dx, d_row_probs, dprobs, _stream(d_rows))
        return (dx if want_dx else None), dprobs


class UnpermuteSink:
    """out: the rows summed back into token order [T, H] (no weights)."""
    collective = False
    weighted = False

    def __init__(self, plan):
        self.plan = plan

    def forward(self, y, probs):
        if _nodes is not None:
            return _nodes.unpermute(y, None, self.plan._ref), None
        out = y.new_empty(self.plan.num_tokens, y.shape[1])
        _C.unpermute(y, self.plan._view, out, None, _stream(y))
        return out, None

    def backward(self, dout, probs, kept, rows_shape):
        if _nodes is not None:
            return _nodes.unpermute_backward(dout, rows_shape[0], self.plan._ref), None
        dy = dout.new_empty(rows_shape)
        _C.unpermute_backward(dout, self.plan._view, None, None, dy, None, _stream(dout))
        return dy, None


class DispatchSource:
    """x: this rank's tokens; the rows are those the experts of this rank
    receive (moeflow.ep.dispatch, its arguments already checked). The MLP's
    rows carry no probs: the combine applies them."""
    collective = True
    recompute = False  # the rows came from other ranks: kept

    def __init__(self, dispatch_args):
        self.args = dispatch_args  # (ids, probs, scales, handle)

    def groups(self):
        h = self.args[3]
        return h.expert_row_offsets, h.tokens_per_expert

    def forward(self, x, probs):
        from .ep import _dispatch_forward
        return _dispatch_forward(x, *self.args), None

    def backward(self, d_rows, d_row_probs, want_dx):
        from .ep import _dispatch_backward
        return _dispatch_backward(self.args[3], d_rows), None


class QuantizedDispatchSource(DispatchSource):
    """DispatchSource of an FP8 group (FP8 on the wire, the blockwise
    recipe): the dispatch quantizes the tokens and the received 1x128 codes
    and scales are FC1's input as they arrive (``forward_blockwise``). The
    rows FC1's weight gradient reads come from those codes: dequantized in
    backward (``rows16``, a 16-bit wgrad) or, for an FP8 wgrad, their columnwise
    codes (``requantize_columnwise``: those of the dequantized rows). The
    rows' gradient goes home in the group's ``backward_dtype``."""
    codes_only = True

    def forward_blockwise(self, x, probs, transposed=False):
        from . import _fp8_ops
        from .ep import _dispatch_forward
        h = self.args[3]
        q = _dispatch_forward(x, *self.args)
        s = h.row_scales
        if not transposed:
            return q, s, None
        # the columnwise codes of the rows rows16() gives, without writing them
        q_t, s_t = _fp8_ops.requantize_columnwise(q, s, x.dtype)
        return q, s, None, (q_t, s_t)

    def rows16(self, q, s, dtype):
        # the rows the groups hold only (the buffer is sized for the worst case);
        # the GEMMs never read the rows past them
        from . import _fp8_ops
        return _fp8_ops.dequantize(q, s, dtype=dtype, rows_used=self.args[3].total_rows)


class CombineSink:
    """out: the rows brought home, weighted by the node's probs (the
    dispatch's [T, K] probs) when given (moeflow.ep.combine)."""
    collective = True

    def __init__(self, handle):
        self.handle = handle

    @property
    def weighted(self):
        return self.handle.weighted

    def forward(self, y, probs):
        from .ep import _combine_forward
        self.dtype = y.dtype
        return _combine_forward(y, probs, self.handle)

    def backward(self, dout, probs, kept, rows_shape):
        from .ep import _combine_backward
        return _combine_backward(self.handle, probs, kept, self.dtype, dout)
