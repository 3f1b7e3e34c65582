"""The grouped expert MLP with FP8 GEMMs: ``ops.grouped_mlp(...,
precision="fp8-blockwise" | "fp8-tensorwise")`` (docs/fp8.md, "Precision
recipes").

Forward and both input gradients run through the FP8 grouped GEMM (e4m3
codes, float32 scales promoted every 128 of K): FC1 on x's codes, FC2 on
act(h) * p's codes (1x128 blocks: one pass over h), FC2's dgrad on dy's
codes with W2 transposed, FC1's dgrad on d_h's codes with W1 transposed.
The weights are quantized in every call (128 x 128 blocks, or one scale per
tensor), or once while they do not change (``fp8_weight_cache``). The
weight gradients are 16-bit GEMMs on the 16-bit activations (x, a
recomputed from h, dy, d_h), as the bf16 MLP computes them, or with
``fp8_wgrad`` FP8 GEMMs on their codes along the rows (tensorwise: the
rowwise codes transposed, a's kept from FC2's forward).
"""
from typing import Optional, Tuple

import torch

from . import _C, _mlp_io, ops
from ._ops_common import _grad_into, _may_drop_early, _stream, _take_held

RECIPES = ("bf16", "fp8-blockwise", "fp8-tensorwise")


def _quantize(t: torch.Tensor, scaling: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return ops.quantize(t, "e4m3", scaling)


def quantize_rows(t: torch.Tensor, recipe: str, offsets: torch.Tensor,
                  real_rows: Optional[torch.Tensor],
                  amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's A operand [rows, K]: e4m3 codes and [rows, K/128] scales of
    the rows up to offsets[-1] (the codes and scales past it are left
    unwritten), or for fp8-tensorwise one scale [1]: the amax of the groups'
    real rows only (pad rows and the rows past the groups are never read and
    may hold anything; their codes are 0), or ``amax`` when given (that
    amax)."""
    if recipe == "fp8-blockwise":
        # the rows up to the groups' end only (an EP receive buffer is sized
        # for the worst case); the GEMMs never read the rows past it
        return ops.quantize(t, "e4m3", "1x128",
                            rows_used=offsets[-1:] if offsets is not None else None)
    return ops.quantize_group_rows(t, offsets, real_rows, amax=amax)


def quantize_both_ways(t: torch.Tensor, recipe: str, offsets: torch.Tensor,
                       real_rows: Optional[torch.Tensor], amax: Optional[torch.Tensor] = None):
    """(q, scales, q_t, scales_t): t's rowwise codes (:func:`quantize_rows`)
    and its columnwise ones for the FP8 wgrad. Blockwise: both 1x128
    orientations from one read; tensorwise: the rowwise codes and their
    transpose from one pass (one scale, so the same values)."""
    if recipe == "fp8-blockwise":
        return ops.quantize_rowwise_columnwise(t)
    q, sc, q_t = ops.quantize_group_rows(t, offsets, real_rows, transposed=True, amax=amax)
    return q, sc, q_t, sc


def quantize_weight(w: torch.Tensor, recipe: str,
                    transpose: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Expert weights [E, N, K] -> codes [E, N, K] and scales [E, N/128, K/128]
    (128 x 128 blocks), or one scale [1] for the whole tensor (tensorwise);
    ``transpose``: those of W^T, [E, K, N] and [E, K/128, N/128] (the same
    blocks transposed; the same scale)."""
    E, N, K = w.shape
    flat = w.detach().reshape(E * N, K)
    if recipe != "fp8-blockwise":
        q, s = ops.quantize_group_rows(flat)
        q = q.view(E, N, K)
        return (ops.transpose_codes(q) if transpose else q), s
    if transpose:  # W^T's codes straight from W: one read, no W codes written
        _, _, q_t, s_t = ops.quantize_rowwise_columnwise(w.detach(), rowwise=False,
                                                         scaling="128x128")
        return q_t, s_t
    q, s = _quantize(flat, "128x128")
    return q.view(E, N, K), s.view(E, N // 128, K // 128)


_CACHE = "_moeflow_fp8_codes"  # the attribute of a weight that holds its cached codes


def weight_codes(w: torch.Tensor, recipe: str, transpose: bool, cache: bool,
                 both: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight(w, recipe, transpose), or with ``cache`` the codes kept
    on the weight itself (attribute ``_moeflow_fp8_codes``) while the weight
    is unchanged: same storage, shape and version counter (an optimizer's
    in-place step, ``copy_`` or ``load_state_dict`` bumps the version;
    writes through ``w.data`` or into the storage by other means do not:
    then call :func:`clear_weight_cache`); not while a CUDA graph is being
    captured (the graph quantizes, so replays follow the weights). The
    transposed codes are made from the cached ones (the same values as
    quantizing W^T: the blocks only move), or with ``both`` (a forward whose
    backward will run the dgrads) cached with W's from the same read.
    Costs 1 byte per weight element per orientation."""
    if not cache or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Under CUDA-graph capture the lookup would run once, on the host:
        # the graph quantizes instead, so that every replay sees the weights.
        return quantize_weight(w, recipe, transpose)
    key = (recipe, w.data_ptr(), tuple(w.shape), w._version)
    held = getattr(w, _CACHE, None)
    if held is None or held[0] != key:
        held = (key, {})
        setattr(w, _CACHE, held)
    codes = held[1]
    if recipe == "fp8-blockwise" and not codes and both:
        # The backward's dgrad will want W^T's codes too: both from one read.
        q, s, q_t, s_t = ops.quantize_rowwise_columnwise(w.detach(), scaling="128x128")
        codes[False], codes[True] = (q, s), (q_t, s_t)
    if transpose not in codes:
        if transpose and False in codes:
            q, s = codes[False]
            codes[True] = (ops.transpose_codes(q),
                           s if s.dim() == 1 else s.transpose(1, 2).contiguous())
        else:
            codes[transpose] = quantize_weight(w, recipe, transpose)
    return codes[transpose]


def clear_weight_cache(*weights: torch.Tensor) -> None:
    """Drops the cached FP8 codes of these weights (after updating them in a
    way that does not bump their version counter, e.g. through ``.data``)."""
    for w in weights:
        if hasattr(w, _CACHE):
            delattr(w, _CACHE)


def _gemm(a: torch.Tensor, w: torch.Tensor, recipe: str, offsets: torch.Tensor,
          real_rows: Optional[torch.Tensor], transpose: bool, cache: bool,
          out: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None,
          both: bool = False) -> torch.Tensor:
    """out[rows of e] = a @ W_e^T (transpose: a @ W_e), both operands in FP8
    (out: optional, rows may be strided; amax: a's, when already computed;
    both: as :func:`weight_codes`')."""
    aq, a_s = quantize_rows(a, recipe, offsets, real_rows, amax)
    wq, w_s = weight_codes(w, recipe, transpose, cache, both)
    return ops.grouped_gemm_fp8_forward(aq, a_s, wq, w_s, offsets, real_rows, out=out)


def check(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, bias1, bias2, recipe: str,
          wgrad_store, activation: str) -> None:
    """The FP8 recipes' requirements, with the argument named."""
    if recipe not in RECIPES:
        raise ValueError(f"precision must be one of {RECIPES}, got {recipe!r}")
    if x.dim() != 2 or fc1.dim() != 3 or fc2.dim() != 3:
        raise ValueError(f"x must be [rows, H], fc1 [E, N1, H] and fc2 [E, H, F], got "
                         f"{list(x.shape)}, {list(fc1.shape)} and {list(fc2.shape)}")
    if not (x.shape[1] == fc1.shape[2] == fc2.shape[1] and fc1.shape[0] == fc2.shape[0]):
        raise ValueError(f"x [rows, H], fc1 [E, N1, H] and fc2 [E, H, F] disagree: "
                         f"{list(x.shape)}, {list(fc1.shape)}, {list(fc2.shape)}")
    for name, t in (("x", x), ("fc1", fc1), ("fc2", fc2)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"precision={recipe!r} needs bfloat16 {name}, got {t.dtype}")
    H, N1, F = fc1.shape[2], fc1.shape[1], fc2.shape[2]
    for name, n in (("hidden size (fc1.shape[2])", H), ("FC1 width (fc1.shape[1])", N1),
                    ("FFN size (fc2.shape[2])", F)):
        if n % 128:
            raise ValueError(f"precision={recipe!r} needs the {name} to be a multiple of 128, "
                             f"got {n}")
    gated = activation in ("swiglu", "geglu", "clamped_quick_geglu")
    if N1 != (2 * F if gated else F):
        raise ValueError(f"fc1.shape[1] must be {'2 x ' if gated else ''}fc2.shape[2] = "
                         f"{2 * F if gated else F} for activation {activation!r}, got {N1}")
    if bias1 is not None or bias2 is not None:
        raise ValueError(f"precision={recipe!r} takes no biases (the FP8 GEMM has no bias "
                         f"epilogue)")
    if wgrad_store is not None:
        raise ValueError(f"precision={recipe!r} does not take a wgrad_store")


class GroupedMlpFp8(torch.autograd.Function):
    # args: (offsets, real_rows, cfg, recipe, main_grads or None, plan to
    # unpermute with or None, cache the weights' codes, FP8 wgrad, the rows'
    # source or None: _mlp_io.PermuteSource, x and probs then the tokens and
    # their slots' probs; accumulate_into_grad); ctx None: called without
    # autograd.
    @staticmethod
    def forward(ctx, x, fc1, fc2, probs, args):
        offsets, real_rows, cfg, recipe, main, plan, cache, wgrad8, source, into_grad = args
        x = tokens = x.detach().contiguous()
        probs = None if probs is None else probs.detach()
        x_t = None  # x's columnwise codes and scales (FC1's FP8 wgrad), instead of x
        xq = None  # x's rowwise codes and scales (FC1's input)
        x_codes = (None, None)  # codes from the wire kept for FC1's 16-bit wgrad, instead of x
        want_x_t = wgrad8 and ctx is not None and fc1.requires_grad
        # FC1's 16-bit weight gradient reads the rows: kept from here, or
        # permuted again from the tokens in backward (recompute_permute).
        rows16 = ctx is not None and fc1.requires_grad and not wgrad8
        again = isinstance(source, _mlp_io.PermuteSource) and source.recompute
        # FP8 on the wire (QuantizedDispatchSource): the rows arrive as codes
        wire8 = getattr(source, "codes_only", False)
        codes_first = wire8 or (isinstance(source, _mlp_io.PermuteSource) and
                                (again or not rows16))
        if codes_first and recipe == "fp8-tensorwise":
            # The codes straight from the tokens: no 16-bit rows.
            xq, xs, xq_t, probs = source.forward_tensorwise(x, probs, want_x_t)
            x = None
            if want_x_t:
                x_t = (xq_t, xs)
        elif codes_first:  # blockwise: the rowwise codes, and the columnwise ones
            got = source.forward_blockwise(x, probs, want_x_t)
            xq, xs, probs = got[:3]
            x_t = got[3] if want_x_t else None
            # A 16-bit FC1 wgrad over codes that came over the wire reads them
            # dequantized in backward: the dispatch's handle holds the codes
            # until then anyway, so keeping 16-bit rows would only add memory.
            x = None
            if wire8 and rows16:
                x_codes = (xq, xs)
        else:
            if source is not None:  # the experts' rows and each row's prob
                x, probs = source.forward(x, probs)
            if want_x_t:
                xq, xs, xq_t, xs_t = quantize_both_ways(x, recipe, offsets, real_rows)
                x_t = (xq_t, xs_t)
        if offsets is None:  # the groups are the dispatch's (known from here on)
            offsets, real_rows = source.groups()
        if xq is not None:
            w1q, w1s = weight_codes(fc1, recipe, False, cache, ctx is not None)
            h = ops.grouped_gemm_fp8_forward(xq, xs, w1q, w1s, offsets, real_rows)
            del xq, xs
        else:
            h = _gemm(x, fc1, recipe, offsets, real_rows, False, cache,  # bf16 [rows, N1]
                      both=ctx is not None)
        p = None if probs is None else probs.detach().contiguous()
        # Tensorwise FP8 wgrad: a's codes as FC2's forward reads them, transposed
        # in the same pass, are the ones its weight gradient needs (kept to
        # backward instead of quantizing a from h again: rows x F bytes).
        keep_a_t = (ctx is not None and wgrad8 and recipe != "fp8-blockwise"
                    and fc2.requires_grad)
        # a = act(h) * p quantized from h, a itself not stored (tensorwise: h read twice)
        got = ops.activation_quantize(h, offsets=offsets, real_rows=real_rows, probs=p,
                                      activation=cfg[0], glu_interleave=cfg[1], alpha=cfg[2],
                                      limit=cfg[3], offset=cfg[4],
                                      scaling="1x128" if recipe == "fp8-blockwise"
                                      else "tensorwise", transposed=keep_a_t)
        aq, a_s = got[0], got[1]
        w2q, w2s = weight_codes(fc2, recipe, False, cache, ctx is not None)
        y = ops.grouped_gemm_fp8_forward(aq, a_s, w2q, w2s, offsets, real_rows)
        del aq
        if ctx is not None:
            ctx.set_materialize_grads(False)
            ctx.cfg, ctx.recipe, ctx.main, ctx.plan, ctx.cache = cfg, recipe, main, plan, cache
            ctx.wgrad8, ctx.source, ctx.into_grad = wgrad8, source, into_grad
            ctx.rows_dtype = tokens.dtype
            # the rows for FC1's 16-bit wgrad, or the tokens (recompute_permute)
            saved_x = (tokens if again else x) if rows16 else None
            x_t = x_t if x_t is not None else (None, None)
            a_t = (got[2], a_s) if keep_a_t else (None, None)
            # h and a's codes held by the node rather than saved where its
            # backward may drop them after FC2's weight gradient (_may_drop_early)
            ctx.held = [h, a_t[0]] if _may_drop_early() else None
            ctx.save_for_backward(saved_x, fc1, fc2, p, offsets, real_rows,
                                  None if ctx.held else h, *x_t,
                                  None if ctx.held else a_t[0], a_t[1], *x_codes)
        if plan is None:
            return y
        out = y.new_empty(plan.num_tokens, y.shape[1])
        _C.unpermute(y, plan._view, out, None, _stream(y))
        return out

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 5
        (x, fc1, fc2, probs, offsets, real_rows, h, xq_t, xs_t, aq_t, as_t, xq_w,
         xs_w) = ctx.saved_tensors
        # [h, a's codes], dropped after FC2's weight gradient
        held = _take_held(ctx, (h, aq_t))
        h, aq_t = held
        cfg, recipe, main, plan, cache = ctx.cfg, ctx.recipe, ctx.main, ctx.plan, ctx.cache
        need = ctx.needs_input_grad
        wgrad8 = ctx.wgrad8
        s = _stream(h)
        rows, h_dtype, dev = h.shape[0], h.dtype, h.device
        dy_t = None  # dY's columnwise codes and scales (FC2's FP8 wgrad)
        dyq = None  # dY's rowwise codes and scales (FC2's dgrad input)
        if plan is not None:
            dout = dy.contiguous()
            if recipe == "fp8-tensorwise" and (wgrad8 or not need[2]):
                # The codes straight from dout: no 16-bit rows (no wgrad reads them).
                t = bool(wgrad8 and need[2])
                got = ops.unpermute_backward_quantize(dout, plan, scaling="tensorwise",
                                                      transposed=t)
                dyq, dys = got[0], got[1]
                dy_t = (got[2], dys) if t else None
                dy = None
            elif wgrad8 or not need[2]:
                # Blockwise, no 16-bit rows either: the rowwise codes from dout
                # read once, and for the FP8 wgrad the rows' columnwise codes
                # gathered from dout (unpermute's rows without weights are
                # permute's rows of dout).
                dyq, dys = ops.unpermute_backward_quantize(dout, plan)
                if wgrad8 and need[2]:
                    dy_t = _mlp_io.columnwise_codes(dout, plan)
                dy = None
            else:
                dy = dout.new_empty(rows, fc2.shape[1])
                _C.unpermute_backward(dout, plan._view, None, None, dy, None, s)
            del dout
        else:
            dy = dy.contiguous()
        F = fc2.shape[2]
        d_h = torch.empty_like(h)
        # FC2's dgrad writes d(a) straight into d_h's last F columns (all of them when plain)
        if dyq is None and wgrad8 and need[2]:
            dyq, dys, dyq_t, dys_t = quantize_both_ways(dy, recipe, offsets, real_rows)
            dy_t = (dyq_t, dys_t)
        if dyq is not None:
            w2q, w2s = weight_codes(fc2, recipe, True, cache)
            ops.grouped_gemm_fp8_forward(dyq, dys, w2q, w2s, offsets, real_rows,
                                         out=d_h[:, d_h.shape[1] - F:])
            del dyq, dys, dy
            dy = None
        else:
            _gemm(dy, fc2, recipe, offsets, real_rows, True, cache, out=d_h[:, d_h.shape[1] - F:])
        dprobs = None
        if probs is not None and need[3]:
            dprobs = torch.empty(rows, dtype=torch.float32, device=h.device)
        # tensorwise: d(h)'s amax from the kernel that writes d(h) (no amax pass)
        dh_amax = (torch.empty(1, dtype=torch.float32, device=h.device)
                   if recipe == "fp8-tensorwise" else None)
        _C.grouped_mlp_activation_backward(h, offsets, real_rows, probs, *cfg, d_h, dprobs, s,
                                           dh_amax)
        del h, aq_t  # in held
        dh_q = None  # d_h's codes both ways (FC1's dgrad and FP8 wgrad)
        if wgrad8 and need[1]:
            dh_q = quantize_both_ways(d_h, recipe, offsets, real_rows, dh_amax)
            del d_h
            d_h = None

        def wgrad(fc):
            if not need[fc]:
                return None
            w = fc2 if fc == 2 else fc1
            # main_grad, or the weight's .grad added into in place by the
            # wgrad GEMM (accumulate_into_grad), or a new gradient
            g = main[fc - 1] if main is not None else (_grad_into(ctx, fc) if ctx.into_grad
                                                        else None)
            acc = g is not None
            if not acc:
                g = torch.empty_like(w)
            if fc == 2:
                if dy_t is not None and recipe != "fp8-blockwise":
                    # a's transposed codes from the forward (one scale)
                    ops.grouped_gemm_fp8_wgrad(dy_t[0], dy_t[1], held[1], as_t, offsets,
                                               real_rows, out=g, accumulate=acc)
                    return None if acc else g
                a = torch.empty(rows, F, dtype=h_dtype, device=dev)
                _C.grouped_mlp_recompute_activation(held[0], offsets, real_rows, probs, *cfg, a,
                                                    s)
                if dy_t is not None:
                    _, _, ac_t, acs_t = ops.quantize_rowwise_columnwise(a, rowwise=False)
                    del a
                    ops.grouped_gemm_fp8_wgrad(dy_t[0], dy_t[1], ac_t, acs_t, offsets, real_rows,
                                               out=g, accumulate=acc)
                else:
                    _C.grouped_mlp_backward_wgrad(dy, None, offsets, real_rows, None, a, None,
                                                  None, g, None, None, acc, s)
            elif dh_q is not None:
                ops.grouped_gemm_fp8_wgrad(dh_q[2], dh_q[3], xq_t, xs_t, offsets, real_rows,
                                           out=g, accumulate=acc)
            else:
                if xq_w is not None:  # the wire's codes, dequantized for this GEMM only
                    rows_x = ctx.source.rows16(xq_w, xs_w, ctx.rows_dtype)
                elif ctx.source is None or not ctx.source.recompute:
                    rows_x = x
                else:
                    rows_x = ctx.source.rows(x)
                _C.grouped_mlp_backward_wgrad(None, rows_x, offsets, real_rows, None, None, d_h,
                                              g, None, None, None, acc, s)
            return None if acc else g

        g2 = wgrad(2)
        held[0] = held[1] = None  # h and a's codes read for the last time
        del dy, dy_t
        dx = None
        source = ctx.source
        # (a collective source's backward runs on every rank)
        if need[0] or (source is not None and (dprobs is not None or source.collective)):
            if dh_q is not None:
                w1q, w1s = weight_codes(fc1, recipe, True, cache)
                dx = ops.grouped_gemm_fp8_forward(dh_q[0], dh_q[1], w1q, w1s, offsets, real_rows)
            else:
                dx = _gemm(d_h, fc1, recipe, offsets, real_rows, True, cache, amax=dh_amax)
            if source is not None:  # the tokens' gradients; the rows' freed here
                dx, dprobs = source.backward(dx, dprobs, need[0])
        g1 = wgrad(1)
        return dx, g1, g2, dprobs, None
