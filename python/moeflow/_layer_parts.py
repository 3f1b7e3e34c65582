"""Parts of ``MoELayer`` (re-exported by ``moeflow.layer``): the autograd
function that attaches the router's auxiliary losses to the layer's output,
and the shared expert."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from . import _compiled, ops
from ._checkpoint import _GATED

if TYPE_CHECKING:
    from .layer import MoELayer


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attaches an auxiliary loss to an activation (Megatron-Core's
    MoEAuxLossAutoScaler): forward returns ``activation`` unchanged; backward
    passes its gradient through and sends ``scale`` (a float32 device tensor,
    read at backward time) as the gradient of ``loss``. So the loss joins
    the backward of whatever uses the activation, without being added to
    the main loss."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor,
                scale: Optional[torch.Tensor]):
        # The scale is kept as an attribute, not saved: set_loss_scale may
        # change it in place between forward and backward.
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return activation

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        dloss = torch.ones(shape, dtype=dtype, device=device)
        if ctx.scale is not None:
            dloss = dloss * ctx.scale.to(dtype)
        return grad_output, dloss, None


class SharedExpertMLP(torch.nn.Module):
    """The shared expert (Megatron-Core's SharedExpertMLP): a dense MLP that
    every token goes through, beside the routed experts. Parameters with
    Megatron's names: ``linear_fc1.weight`` [N1, H] (N1 = 2F gated, gate rows
    then up rows), ``linear_fc2.weight`` [H, F], and with ``gate`` a
    ``gate_weight`` [1, H] (``moe_shared_expert_gate``: the output is scaled
    by sigmoid(x gate_weight^T)). Computed by moeflow's grouped MLP as one
    group, with the routed experts' activation."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str, gate: bool,
                 params_dtype: torch.dtype, device=None):
        super().__init__()
        H, F = hidden_size, ffn_hidden_size
        n1 = 2 * F if activation in _GATED else F
        kw = dict(bias=False, dtype=params_dtype, device=device)
        self.linear_fc1 = torch.nn.Linear(H, n1, **kw)
        self.linear_fc2 = torch.nn.Linear(F, H, **kw)
        self.gate_weight = torch.nn.Parameter(
            torch.empty((1, H), dtype=params_dtype, device=device)) if gate else None
        self.hidden_size, self.ffn_hidden_size = H, F
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w, fan_in in ((self.linear_fc1.weight, self.hidden_size),
                              (self.linear_fc2.weight, self.ffn_hidden_size),
                              (self.gate_weight, self.hidden_size)):
                if w is not None:
                    bound = 1.0 / math.sqrt(fan_in)
                    w.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, layer: "MoELayer") -> torch.Tensor:
        """x [T, H] in params_dtype -> [T, H]."""
        T = x.shape[0]
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        v1, v2 = w1.unsqueeze(0), w2.unsqueeze(0)  # one group: [1, N1, H], [1, H, F]
        fusion = layer.gradient_accumulation_fusion
        if fusion:
            for v, w in ((v1, w1), (v2, w2)):
                g = getattr(w, "main_grad", None)
                v.main_grad = None if g is None else g.view(v.shape)
        if torch.compiler.is_compiling():  # traced: the custom operator (docs/python.md)
            cfg = (layer.activation, 0) + layer._mlp_cfg()[2:]  # halves, never interleaved
            y = _compiled.experts(x, None, None, v1, v2, None, None, 1, 1, cfg)
        else:
            offsets = torch.arange(2, dtype=torch.int64, device=x.device) * T  # [0, T], no sync
            y = ops.grouped_mlp(x, v1, v2, offsets=offsets, activation=layer.activation,
                                alpha=layer.activation_alpha, limit=layer.activation_limit,
                                offset=layer.activation_offset, accumulate_into_main_grad=fusion,
                                recompute_activation=layer.recompute_activation,
                                wgrad_store=layer._wgrad_store, _grad_params=(w1, w2, None, None))
        if self.gate_weight is not None:
            y = y * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return y
