"""The bf16 / fp16 grouped MLP's autograd node (ops.grouped_mlp): FC1, the
activation and FC2 forward; backward the dgrads, then the weight gradients
(now, or queued on a WgradStore), with the node's rows from a source and
its output through a sink (_mlp_io)."""
from __future__ import annotations

import torch

from . import _C
from ._ops_common import _grad_into, _may_drop_early, _nodes, _rows, _stream, _take_held


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _GroupedMlp(torch.autograd.Function):
    # args: (offsets, real_rows, cfg, opts), nothing differentiable, in one
    # argument (apply() costs per input). cfg: (activation, glu_interleave,
    # alpha, limit, offset); opts: (main_grads or None, recompute_activation,
    # wgrad_store or None, the parameters a delayed wgrad adds its gradients
    # into, the rows' source or None, the output's sink or None: _mlp_io,
    # accumulate_into_grad;
    # with a source, x and probs are its inputs, and offsets None means the
    # source's groups).
    # ctx None: called without autograd (grouped_mlp's fast path).
    @staticmethod
    def forward(ctx, x, fc1, fc2, bias1, bias2, probs, args):
        offsets, real_rows, cfg, opts = args
        source, sink = opts[4], opts[5]
        x = tokens = _rows(x)
        row_probs = probs
        if source is not None:  # the experts' rows (and each row's prob)
            x, row_probs = source.forward(x, probs)
            if offsets is None:
                offsets, real_rows = source.groups()
        if _nodes is not None:  # the outputs allocated by the C++ call
            y, h, a = _nodes.grouped_mlp_forward(x, fc1, fc2, bias1, bias2, offsets, real_rows,
                                                 row_probs, *cfg)
        else:
            rows = x.shape[0]
            y = x.new_empty(rows, fc2.shape[1])
            h = x.new_empty(rows, fc1.shape[1])
            a = x.new_empty(rows, fc2.shape[2])
            _C.grouped_mlp_forward(x, fc1, fc2, bias1, bias2, offsets, real_rows, row_probs,
                                   *cfg, y, h, a, _stream(x))
        out, kept = y, None
        if sink is not None:
            if opts[1]:
                a = None  # not kept (recompute_activation): freed before the sink's output
            out, kept = sink.forward(y, probs)
        if ctx is not None:
            ctx.set_materialize_grads(False)
            ctx.cfg, ctx.opts = cfg, opts
            # Keeping only h (recompute_activation): a is recomputed before the
            # weight gradients, so it does not live from forward to backward.
            # probs: the sink's weights (the rows' own are row_probs).
            # recompute_permute: the tokens instead of the rows (FC1's weight
            # gradient permutes them again).
            keep = tokens if source is not None and source.recompute else x
            a = None if opts[1] else a
            # h and a held by the node rather than saved where its backward
            # may drop them once read for the last time (_may_drop_early)
            ctx.held = [h, a] if _may_drop_early() else None
            ctx.save_for_backward(keep, fc1, fc2, bias1, bias2, row_probs, offsets, real_rows,
                                  *((None, None) if ctx.held else (h, a)),
                                  probs if sink is not None and sink.weighted else None, kept)
        return out

    @staticmethod
    def backward(ctx, dy):
        main, _, store, params, source, sink, into_grad = ctx.opts
        if dy is None and not (sink is not None and sink.collective):
            return (None,) * 7  # (a collective sink's backward runs on every rank)
        # x: the rows, or with recompute_permute the tokens
        x, fc1, fc2, bias1, bias2, probs, offsets, real_rows, h, a, sink_probs, kept = \
            ctx.saved_tensors
        held = _take_held(ctx, (h, a))  # [h, a], dropped once read for the last time
        h, a = held
        cfg, need = ctx.cfg, ctx.needs_input_grad
        s = _stream(h)
        rows = h.shape[0]
        node_dprobs = None  # the gradient of the node's probs from the sink
        if sink is not None:  # the rows' gradient: local, freed once FC2's wgrad has read it
            dy, node_dprobs = sink.backward(None if dy is None else _rows(dy), sink_probs, kept,
                                            (rows, fc2.shape[1]))
            del kept
        else:
            dy = _rows(dy)
        d_h = torch.empty_like(h)
        dprobs = None  # the rows' probs' gradient
        if probs is not None and need[5]:
            dprobs = torch.empty(rows, dtype=torch.float32, device=h.device)
        # FC2 dgrad + the activation's backward: d_h (dx comes after FC2's wgrad).
        _C.grouped_mlp_backward_dgrad(dy, fc1, fc2, bias1, bias2, offsets, real_rows, probs,
                                      *cfg, h, None, d_h, dprobs, s)
        del h, a  # in held
        want = (need[1], need[2], bias1 is not None and need[3], bias2 is not None and need[4])

        def wgrad(dy, act, fc):
            """FC2's (fc=2: dW2, db2) or FC1's (fc=1: dW1, db1) gradients in the
            parameters' dtypes (None where not wanted, or where main_grad
            received them)."""
            st = _stream(d_h)
            w_want, b_want = (want[1], want[3]) if fc == 2 else (want[0], want[2])
            if not (w_want or b_want):
                return None, None
            w, b = (fc2, bias2) if fc == 2 else (fc1, bias1)
            if fc == 2 and w_want and act is None:
                act = d_h.new_empty(rows, fc2.shape[2])
                _C.grouped_mlp_recompute_activation(held[0], offsets, real_rows, probs, *cfg, act,
                                                    st)
            if fc == 2 and store is None:
                held[0] = None  # h read for the last time (d_h and a exist)
            x_rows = None  # FC1's input rows (its weight gradient's operand)
            if fc == 1:
                x_rows = source.rows(x) if source is not None and source.recompute else x
            # acc: the GEMM adds into main_grad, or into the weight's .grad
            # (accumulate_into_grad, where autograd would add it in place;
            # not for a delayed wgrad, which runs after backward).
            g = None
            acc = main is not None
            if w_want:
                if acc:
                    g = main[fc - 1]
                elif into_grad and store is None:
                    g = _grad_into(ctx, fc)
                    acc = g is not None
                if g is None:
                    g = torch.empty_like(w)
            # The bias gradient is summed into db too when acc: start it at zero.
            db = None
            if b_want:
                db = (torch.zeros if acc else torch.empty)(b.shape, dtype=torch.float32,
                                                           device=d_h.device)
            dw1, dw2 = (None, g) if fc == 2 else (g, None)
            db1, db2 = (None, db) if fc == 2 else (db, None)
            _C.grouped_mlp_backward_wgrad(dy if fc == 2 else None, x_rows,
                                          offsets, real_rows, None, act if fc == 2 else None,
                                          d_h if fc == 1 else None, dw1, dw2, db1, db2, acc, st)
            return (None if acc else g), (None if db is None else db.to(b.dtype))

        def fc1_dgrad():
            """(dx, dprobs) of the node's inputs x and probs: the rows', or
            with a source its inputs' (the rows' gradient freed on return)."""
            if source is None:
                if not need[0]:
                    return None, dprobs
            elif not need[0] and (source.collective or dprobs is None):
                return None, node_dprobs
            dx = d_h.new_empty(rows, fc1.shape[2])
            _C.grouped_mlp_backward_fc1_dgrad(d_h, fc1, fc2, offsets, real_rows, *cfg, dx, s)
            if source is None:
                return dx, dprobs
            dx, dp = source.backward(dx, dprobs, need[0])
            return dx, (dp if node_dprobs is None else node_dprobs)

        if store is None:
            # FC2's weight gradient first: then dy and a are free before dx
            # and FC1's weight gradient are allocated (the step's peak).
            g2, gb2 = wgrad(dy, held[1], 2)
            held[1] = None
            del dy
            dx, dprobs = fc1_dgrad()
            g1, gb1 = wgrad(None, None, 1)
            return dx, g1, g2, gb1, gb2, dprobs, None

        dx, dprobs = fc1_dgrad()

        def delayed():
            g2, gb2 = wgrad(dy, held[1], 2)
            g1, gb1 = wgrad(None, None, 1)
            for p, g in zip(params, (g1, g2, gb1, gb2)):
                if p is not None and g is not None:
                    _add_grad(p, g.view(p.shape))
        store._pending.append(delayed)
        return dx, None, None, None, None, dprobs, None
