"""``MoELayer``: a Mixture-of-Experts MLP layer as a ``torch.nn.Module`` (needs torch).

    layer = MoELayer(hidden_size=1024, ffn_hidden_size=512, num_experts=64, topk=8,
                     device="cuda")
    out = layer(x)                        # x [..., H] -> out [..., H], x's dtype
    out.sum().backward()                  # includes the aux / z losses' gradients
    layer.last_losses["aux_loss"]         # detached device tensors, for logging

The path, all on x's device and without host synchronisation (a step can be
captured in a CUDA graph):

    logits = ops.router_logits(x, router_weight)        [T, E] float32
    topk_ids, probs, ... = ops.router(logits, ...)       Megatron-Core's router
    plan = ops.Plan(topk_ids, E, align)
    out = ops.grouped_mlp(x, fc1, fc2, plan=plan, probs=probs, permute=True,
                          unpermute=True)
        = ops.unpermute(grouped_mlp(ops.permute(x, plan, probs) ...), plan), one node

With ``ep_group`` (a :class:`moeflow.ep.Group`, expert parallelism) the layer
holds only its rank's L = E / W experts and the path is, in one autograd
node for bf16 (the FP8 recipes chain the three ops)

    rows, tpe, offsets, handle = ep.dispatch(x, topk_ids, probs, ep_group)
    y = ops.grouped_mlp(rows, fc1, fc2, offsets=offsets, real_rows=tpe)
    out = ep.combine(y, handle, probs)                  probs applied here

Options follow Megatron-Core's config (the names in brackets):
``topk`` (moe_router_topk), ``score_function`` (moe_router_score_function),
``pre_softmax`` (moe_router_pre_softmax), ``num_groups`` / ``group_topk``
(moe_router_num_groups / moe_router_group_topk), ``topk_scaling_factor``
(moe_router_topk_scaling_factor), ``use_expert_bias``
(moe_router_enable_expert_bias), ``expert_bias_update_rate``
(moe_router_bias_update_rate), ``load_balancing_type``
(moe_router_load_balancing_type), ``aux_loss_coeff`` / ``z_loss_coeff``
(moe_aux_loss_coeff / moe_z_loss_coeff), ``capacity_factor``
(moe_expert_capacity_factor), ``token_drop_policy``
(moe_token_drop_policy), ``shared_expert_ffn_hidden_size``
(moe_shared_expert_intermediate_size), ``ffn_hidden_size``
(moe_ffn_hidden_size), ``gradient_accumulation_fusion``.
"""
from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional, Union

import torch

from . import _compiled, ops
from . import ep as _ep
from ._checkpoint import _GATED, ExpertCheckpointMixin, megatron_state_dict  # noqa: F401
from ._layer_parts import MoEAuxLossAutoScaler, SharedExpertMLP

__all__ = ["MoELayer", "MoEAuxLossAutoScaler", "SharedExpertMLP"]


_LOSSES = ("aux_loss", "z_loss", "seq_aux_loss")  # the router's, in _loss_stats' order


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """The slots an expert keeps with ``capacity_factor``: Megatron-Core's
    ceil(num_tokens * topk / num_experts * capacity_factor) in double
    precision (router.h's router_capacity, in Python so that Dynamo traces
    it)."""
    return max(math.ceil(num_tokens * topk / num_experts * capacity_factor), 0)


def _integer(value, name: str) -> int:
    """value as an int, where it is one (an int, a numpy or 0-dim integer):
    a float or anything else is refused, naming the argument."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} "
                        f"({type(value).__name__})") from None


class MoELayer(ExpertCheckpointMixin, torch.nn.Module):
    """A token-choice top-k MoE MLP layer: router, permute, grouped expert
    MLP, unpermute (see the module docstring).

    Parameters: ``router_weight`` [E, H] float32 (the router stays in float32,
    as in Megatron-Core); ``fc1_weight`` [E, N1, H] (N1 = 2F for the gated
    activations, gate rows then up rows, or blocks of ``glu_interleave``; F
    otherwise) and ``fc2_weight`` [E, H, F] in ``params_dtype`` (bf16 or
    fp16), each expert's matrix initialised like ``torch.nn.Linear``.

    Activations: those of ``ops.grouped_mlp`` ("swiglu", "geglu",
    "clamped_quick_geglu" with ``activation_alpha`` / ``activation_limit`` /
    ``activation_offset``, "gelu", "relu", "squared_relu"), with
    ``glu_interleave`` for the gated ones.

    Load balancing (Megatron's moe_router_load_balancing_type and
    moe_aux_loss_coeff): ``load_balancing_type`` "aux_loss" (the switch
    loss over the batch), "seq_aux_loss" (the same per sequence, averaged:
    see ``forward``'s ``cu_seqlens``), "none", or a list of them with a list
    of coefficients.

    Expert capacity (``capacity_factor``, Megatron's
    moe_expert_capacity_factor): each expert takes at most
    ceil(T * topk / E * capacity_factor) slots, keeping those of highest
    prob (``token_drop_policy`` "probs") or the first in token order
    ("position"); the dropped slots' count is in ``last_dropped`` ([1]
    int32). None (the default): nothing is dropped.

    Auxiliary losses (``aux_loss_coeff`` / ``z_loss_coeff`` > 0): computed by
    the router when the layer is training and autograd is on (as in
    Megatron-Core, so a no-grad first pass of activation checkpointing adds
    none), attached to the router probabilities with
    :class:`MoEAuxLossAutoScaler`: ``out.backward()`` includes their
    gradients, times the loss scale (``set_loss_scale``, default 1.0).
    Their values, coefficients included, are kept on the device in
    ``last_losses`` ({"aux_loss": t, "seq_aux_loss": t, "z_loss": t}, the
    ones configured; those of the last training forward with autograd on;
    {} in eval mode). The ``last_*`` statistics are views of buffers that
    the next forward overwrites in place (clone to keep them), so that a
    compiled forward records them too, activation checkpointing included.

    Expert bias (``use_expert_bias``, sigmoid scoring only): a float32 [E]
    buffer ``expert_bias`` added to the scores for the expert choice only
    (the probabilities are the unbiased scores), balanced on the device by
    ``bias += rate * sign(mean(tokens_per_expert) - tokens_per_expert)``.
    When: ``expert_bias_update="forward"`` (the default) after the routing
    of every training forward with autograd on; ``"step"`` (Megatron's
    way) once per optimizer step, from the counts of the step's forwards,
    when the training loop calls ``layer.update_expert_bias()``. Use "step"
    with gradient accumulation or activation recomputation: the routing of a
    recomputed forward then sees the same bias as the original one (with
    torch.utils.checkpoint's non-reentrant mode both passes run with
    autograd on and both count).

    ``last_tokens_per_expert`` ([E] int32, detached) holds the last forward's
    per-expert slot counts (with ``capacity_factor``, the slots kept: the
    counts the expert bias balances, as in Megatron-Core),
    ``last_nonfinite`` ([1] int32) its tokens with a NaN / inf router logit
    (a NaN logit is never chosen). Nothing in forward or backward
    synchronises with the host.

    Shared expert (``shared_expert_ffn_hidden_size`` > 0, Megatron's
    moe_shared_expert_intermediate_size): a :class:`SharedExpertMLP` that
    every token goes through, its output added to the routed experts';
    ``shared_expert_gate`` scales it by a learned sigmoid gate. On CUDA it
    runs on a side stream beside the router and routed experts
    (``shared_expert_overlap``, default on), forward and backward.

    Memory and scheduling: ``recompute_activation`` (default on) keeps only
    the FC1 output for backward and recomputes the activation before the
    weight gradients (about 1-2 % of the step's time); ``recompute_permute``
    (default on) keeps the tokens, not their K permuted copies, for FC1's
    weight gradient and permutes them again just before it (one permute,
    about 1 % of the step); the router GEMM keeps
    x in its own dtype, not a float32 copy. ``delay_wgrad_compute``
    (TransformerEngine's name): backward computes the input and router
    gradients only; ``layer.backward_dw()`` then computes the experts'
    weight gradients (e.g. to overlap them with communication).
    ``accumulate_into_grad`` (default on): with gradient accumulation, the
    experts' weight gradients are added into their existing ``.grad`` by
    the wgrad GEMM, in place (``ops.grouped_mlp``'s option of that name).

    Precision (``precision``): "bf16" (default), or "fp8-blockwise" /
    "fp8-tensorwise": the experts' forward and input gradients through the
    FP8 grouped GEMM, their weight gradients in bf16 (``ops.grouped_mlp``'s
    ``precision``; docs/fp8.md). FP8 needs hidden_size and ffn_hidden_size
    multiples of 128, bf16 parameters and align a multiple of 16.
    ``fp8_weight_cache`` (default off): the experts' weight codes are kept
    while the weights' storage and version counter are unchanged (2 bytes
    per expert weight element); an optimizer that writes the weights
    without bumping their version (through ``.data``, e.g. Megatron's
    distributed optimizer) must call ``moeflow.ops.clear_fp8_weight_cache``
    after each step. A step captured in a CUDA graph does not use the cache
    (it quantizes inside the graph, so that replays follow the weights).
    ``fp8_wgrad`` (default off): the weight gradients in FP8 too
    (``ops.grouped_mlp``'s ``fp8_wgrad``); fp8-blockwise needs align (with
    ep_group: the group's) a multiple of 128, fp8-tensorwise of 16.

    Checkpoints, in Megatron-Core's two expert key layouts:

    - ``"grouped"`` (the default): the module's own keys, ``router_weight``,
      ``fc1_weight`` [E, N1, H], ``fc2_weight`` [E, H, F] and ``expert_bias``
      (with ``use_expert_bias``), like Megatron's ``linear_fc1.weight``;
    - ``"per_expert"``: ``fc1_weight0`` ... ``fc1_weight{E-1}`` ([N1, H] each)
      and ``fc2_weight0`` ... ``fc2_weight{E-1}`` ([H, F]), like Megatron's
      ``linear_fc1.weight{i}``; ``router_weight`` / ``expert_bias`` unchanged.

    The shared expert's keys (``shared_experts.linear_fc1.weight`` ...,
    its GLU rows always as halves) are the same in both layouts.

    Expert parallelism (``ep_group``, a :class:`moeflow.ep.Group` whose
    num_experts, topk, hidden_size and dtype match the layer's E, topk, H
    and ``params_dtype``): the router stays over all E experts (replicated
    on every rank: ``router_weight`` [E, H]), the layer holds only the
    rank's local experts ``ep_group.expert_range`` = [first, first + L):
    (an FP8 group, ``dtype=torch.float8_e4m3fn`` with ``scale_cols`` =
    ceil(H/128) of float32 and ``backward_dtype`` the layer's params_dtype,
    puts FP8 on the wire with ``precision="fp8-blockwise"``: the dispatch
    quantizes the tokens and FC1 reads their codes as they arrive; FC1's
    weight gradient reads them dequantized, or with ``fp8_wgrad`` quantized
    columnwise from there);
    ``fc1_weight`` [L, N1, H], ``fc2_weight`` [L, H, F]; tokens go to the
    ranks of their experts and back through ``moeflow.ep.dispatch`` /
    ``combine`` (the group's ``align`` and ``capacity_rows`` apply; slots
    that do not fit are counted in ``last_ep_overflow``, [1] int32, this
    rank's received slots dropped). Every rank must run every forward and
    backward of the layer together. Checkpoints with ``ep_group``:
    ``state_dict()`` holds the local experts only (grouped: ``fc1_weight``
    [L, N1, H]; per-expert: ``fc1_weight{i}`` for the global ids i in the
    expert range); ``load_state_dict`` takes that, or a whole checkpoint
    (grouped [E, ...] or all E per-expert keys) and keeps the local experts;
    ``load_safetensors`` reads a whole checkpoint and keeps the local experts;
    ``save_safetensors`` is not available with ``ep_group`` (it would need
    the other ranks' experts).

    ``state_dict()`` writes the layout ``layer.state_dict_layout`` (default
    "grouped") with the FC1 GLU rows in the order
    ``layer.state_dict_glu_interleave`` (None, the default: the layer's own
    ``glu_interleave``, no conversion; 0: halves [gate; up]; g > 0: blocks of g
    gate rows then g up rows), recorded in the state dict's metadata.
    ``load_state_dict`` accepts either key layout (found from the keys) and
    converts the FC1 rows from the order recorded in the metadata, else
    ``state_dict_glu_interleave``, else the layer's own. Per-expert keys that
    are missing are reported as missing keys; an expert index >= E, both
    layouts at once, or a wrong shape is an error naming the key.

    ``save_safetensors(path, layout=..., glu_interleave=...)`` and
    ``load_safetensors(path)`` do the same through moeflow's C++ safetensors
    code (``moeflow._C``); the file's metadata records the GLU row order.
    All conversions copy bytes: round trips are bitwise exact.
    ``load_megatron_state_dict(sd, prefix=...)`` loads a megatron-core
    MoELayer's keys (``router.weight``, ``experts.linear_fc1.weight<i>``, ...;
    :func:`megatron_state_dict` renames them).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, *,
                 activation: str = "swiglu", glu_interleave: int = 0,
                 activation_alpha: float = 1.702, activation_limit: float = 7.0,
                 activation_offset: float = 1.0, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: int = 0, group_topk: int = 0,
                 topk_scaling_factor: Optional[float] = None, use_expert_bias: bool = False,
                 expert_bias_update_rate: float = 1e-3, expert_bias_update: str = "forward",
                 load_balancing_type: Union[str, List[str]] = "aux_loss",
                 aux_loss_coeff: Union[float, List[float]] = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: Optional[float] = None, token_drop_policy: str = "probs",
                 align: int = 16,
                 shared_expert_ffn_hidden_size: int = 0, shared_expert_gate: bool = False,
                 shared_expert_overlap: bool = True, recompute_activation: bool = True,
                 recompute_permute: bool = True, delay_wgrad_compute: bool = False,
                 gradient_accumulation_fusion: bool = False, accumulate_into_grad: bool = True,
                 precision: str = "bf16",
                 fp8_weight_cache: bool = False, fp8_wgrad: bool = False,
                 params_dtype: torch.dtype = torch.bfloat16,
                 device: Optional[Union[torch.device, str]] = None,
                 ep_group: Optional["_ep.Group"] = None):
        super().__init__()
        H, F, E, K = (_integer(v, n) for v, n in ((hidden_size, "hidden_size"),
                                                  (ffn_hidden_size, "ffn_hidden_size"),
                                                  (num_experts, "num_experts"), (topk, "topk")))
        if min(H, F, E) <= 0:
            raise ValueError(f"hidden_size, ffn_hidden_size and num_experts must be > 0, got "
                             f"{H}, {F}, {E}")
        if not 1 <= K <= E:
            raise ValueError(f"topk must be in [1, num_experts={E}], got {K}")
        if activation not in ops._ACTIVATIONS:
            raise ValueError(f"activation must be one of {ops._ACTIVATIONS}, got {activation!r}")
        gated = activation in _GATED
        glu_interleave = _integer(glu_interleave, "glu_interleave")
        if glu_interleave < 0 or (glu_interleave and (not gated or F % glu_interleave)):
            raise ValueError(f"glu_interleave must be 0 or, with a gated activation, a positive "
                             f"divisor of ffn_hidden_size={F}; got {glu_interleave} with "
                             f"activation {activation!r}")
        num_groups = _integer(num_groups or 0, "num_groups")
        group_topk = _integer(group_topk or 0, "group_topk")
        if num_groups:
            room = group_topk * (E // num_groups) if num_groups > 0 else 0
            if (num_groups < 0 or E % num_groups or not 1 <= group_topk <= num_groups
                    or K % group_topk or K > room):
                raise ValueError(
                    f"group-limited routing needs num_groups dividing num_experts={E}, "
                    f"group_topk in [1, num_groups], topk a multiple of group_topk and at most "
                    f"group_topk * num_experts / num_groups; got num_groups={num_groups}, "
                    f"group_topk={group_topk}, topk={K}")
        elif group_topk:
            raise ValueError(f"group_topk needs num_groups > 0, got group_topk={group_topk} "
                             f"with num_groups={num_groups}")
        if _integer(align, "align") not in (1, 16, 32, 64, 128, 256):
            raise ValueError(f"align must be one of 1, 16, 32, 64, 128, 256, got {align}")
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got "
                             f"{score_function!r}")
        if pre_softmax and score_function != "softmax":
            raise ValueError("pre_softmax needs score_function='softmax'")
        if use_expert_bias and score_function != "sigmoid":
            raise ValueError("use_expert_bias needs score_function='sigmoid' (as Megatron-Core)")
        if params_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"params_dtype must be torch.bfloat16 or torch.float16, got "
                             f"{params_dtype}")
        self.hidden_size, self.ffn_hidden_size, self.num_experts, self.topk = H, F, E, K
        if ep_group is not None:
            if not isinstance(ep_group, _ep.Group):
                raise TypeError(f"ep_group must be a moeflow.ep.Group, got "
                                f"{type(ep_group).__name__}")
            # An FP8 group (FP8 on the wire): the tokens cross as their 1x128
            # codes, which the blockwise recipe's FC1 reads as they arrive.
            wire8 = ep_group.dtype in _ep._FP8
            for what, mine, theirs in (("num_experts", E, ep_group.num_experts),
                                       ("topk", K, ep_group.topk),
                                       ("hidden_size", H, ep_group.hidden_size),
                                       ("params_dtype", params_dtype,
                                        ep_group.backward_dtype if wire8 else ep_group.dtype)):
                if mine != theirs:
                    name = ("backward_dtype (an FP8 group)" if wire8 else "dtype") \
                        if what == "params_dtype" else what
                    raise ValueError(f"ep_group.{name} must equal the layer's {what}={mine}, "
                                     f"got {theirs}")
            if wire8 and (precision != "fp8-blockwise" or ep_group.dtype != torch.float8_e4m3fn
                          or ep_group.scale_cols != -(-H // 128)
                          or ep_group.scale_dtype != torch.float32):
                raise ValueError(
                    f"an FP8 ep_group (FP8 on the wire) needs precision='fp8-blockwise' and a "
                    f"group of float8_e4m3fn with scale_cols={-(-H // 128)} (ceil(H/128)) of "
                    f"float32; got precision={precision!r}, dtype {ep_group.dtype}, "
                    f"scale_cols={ep_group.scale_cols} of {ep_group.scale_dtype}")
        self.ep_group = ep_group
        # The experts this layer holds: [first, last) of the E global ones.
        self.expert_range = (0, E) if ep_group is None else tuple(ep_group.expert_range)
        self.num_local_experts = self.expert_range[1] - self.expert_range[0]
        self.last_ep_overflow: Optional[torch.Tensor] = None
        self.activation, self.glu_interleave = activation, int(glu_interleave)
        self.activation_alpha = float(activation_alpha)
        self.activation_limit = float(activation_limit)
        self.activation_offset = float(activation_offset)
        self.score_function, self.pre_softmax = score_function, bool(pre_softmax)
        self.num_groups, self.group_topk = int(num_groups), int(group_topk)
        self.topk_scaling_factor = topk_scaling_factor
        self.use_expert_bias = bool(use_expert_bias)
        self.expert_bias_update_rate = float(expert_bias_update_rate)
        if expert_bias_update not in ("forward", "step"):
            raise ValueError(f"expert_bias_update must be 'forward' or 'step', got "
                             f"{expert_bias_update!r}")
        self.expert_bias_update = expert_bias_update
        types = [load_balancing_type] if isinstance(load_balancing_type, str) \
            else list(load_balancing_type)
        coeffs = list(aux_loss_coeff) if isinstance(aux_loss_coeff, (list, tuple)) \
            else [aux_loss_coeff] * len(types)
        if len(coeffs) != len(types) or not types:
            raise ValueError(f"aux_loss_coeff must be a float or a list as long as "
                             f"load_balancing_type ({types}), got {aux_loss_coeff}")
        coeff = {"aux_loss": 0.0, "seq_aux_loss": 0.0}
        for t, c in zip(types, coeffs):
            if t not in ("aux_loss", "seq_aux_loss", "none"):
                raise ValueError(f"load_balancing_type must be 'aux_loss', 'seq_aux_loss' or "
                                 f"'none' (or a list of them), got {t!r}")
            if t != "none":
                coeff[t] = float(c)
        self.load_balancing_type = types
        self.aux_loss_coeff, self.seq_aux_loss_coeff = coeff["aux_loss"], coeff["seq_aux_loss"]
        self.z_loss_coeff = float(z_loss_coeff)
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: no dropping), got "
                             f"{capacity_factor}")
        if token_drop_policy not in ("probs", "position"):
            raise ValueError(f"token_drop_policy must be 'probs' or 'position', got "
                             f"{token_drop_policy!r}")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.token_drop_policy = token_drop_policy
        self.align = int(align)
        from . import _fp8_mlp
        if precision not in _fp8_mlp.RECIPES:
            raise ValueError(f"precision must be one of {_fp8_mlp.RECIPES}, got {precision!r}")
        if precision != "bf16":
            for name, n in (("hidden_size", H), ("ffn_hidden_size", F)):
                if n % 128:
                    raise ValueError(f"precision={precision!r} needs {name} to be a multiple "
                                     f"of 128, got {n}")
            if params_dtype != torch.bfloat16:
                raise ValueError(f"precision={precision!r} needs params_dtype=torch.bfloat16, "
                                 f"got {params_dtype}")
            align_used = self.align if ep_group is None else ep_group.align
            if align_used % 16:
                raise ValueError(f"precision={precision!r} needs align (with ep_group: the "
                                 f"group's) to be a multiple of 16, got {align_used}")
            if delay_wgrad_compute:
                raise ValueError(f"precision={precision!r} does not support "
                                 f"delay_wgrad_compute")
        if fp8_wgrad:
            if precision not in ("fp8-blockwise", "fp8-tensorwise"):
                raise ValueError(f"fp8_wgrad=True needs an FP8 precision, got {precision!r}")
            align_used = self.align if ep_group is None else ep_group.align
            if align_used % (128 if precision == "fp8-blockwise" else 16):
                raise ValueError(f"fp8_wgrad=True needs align (with ep_group: the group's) to be "
                                 f"a multiple of {128 if precision == 'fp8-blockwise' else 16}, "
                                 f"got {align_used}")
        self.fp8_wgrad = bool(fp8_wgrad)
        self._groups_align = self.align if ep_group is None else ep_group.align
        self.precision = precision
        self.fp8_weight_cache = bool(fp8_weight_cache)
        self.gradient_accumulation_fusion = bool(gradient_accumulation_fusion)
        self.accumulate_into_grad = bool(accumulate_into_grad)
        self.recompute_activation = bool(recompute_activation)
        self.recompute_permute = bool(recompute_permute)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self._wgrad_store = ops.WgradStore() if self.delay_wgrad_compute else None
        Fs = int(shared_expert_ffn_hidden_size or 0)
        if Fs < 0:
            raise ValueError(f"shared_expert_ffn_hidden_size must be >= 0, got {Fs}")
        if shared_expert_gate and not Fs:
            raise ValueError("shared_expert_gate needs shared_expert_ffn_hidden_size > 0")
        self.shared_expert_overlap = bool(shared_expert_overlap)
        self._side_streams: Dict[torch.device, "torch.cuda.Stream"] = {}

        n1 = 2 * F if gated else F
        self.router_weight = torch.nn.Parameter(
            torch.empty((E, H), dtype=torch.float32, device=device))
        L = self.num_local_experts
        self.fc1_weight = torch.nn.Parameter(
            torch.empty((L, n1, H), dtype=params_dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(
            torch.empty((L, H, F), dtype=params_dtype, device=device))
        self.shared_experts = SharedExpertMLP(H, Fs, activation, bool(shared_expert_gate),
                                              params_dtype, device) if Fs else None
        if self.use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32,
                                                            device=device))
        else:
            self.register_buffer("expert_bias", None)
        # expert_bias_update="step": the counts since the last update_expert_bias().
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(E, dtype=torch.int32, device=device)
                             if self.use_expert_bias and expert_bias_update == "step" else None,
                             persistent=False)
        # The backward scale of the auxiliary losses (read at backward time).
        self.register_buffer("loss_scale", torch.ones((), dtype=torch.float32, device=device),
                             persistent=False)
        # The last forward's statistics (last_tokens_per_expert, ...), written
        # in place, so that a forward traced by torch.compile records them
        # without rebinding attributes, which Dynamo refuses under activation
        # checkpointing: [E] counts, non-finite tokens, dropped slots; the
        # losses in _LOSSES' order.
        self.register_buffer("_stats", torch.zeros(E + 2, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("_loss_stats", torch.zeros(len(_LOSSES), dtype=torch.float32,
                                                        device=device), persistent=False)
        # Checkpoint format of state_dict() (see the class docstring).
        self.state_dict_layout = "grouped"
        self.state_dict_glu_interleave: Optional[int] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's FC1 / FC2 and the router like a ``torch.nn.Linear``
        (uniform in +-1/sqrt(fan_in)); the expert bias to zero."""
        with torch.no_grad():
            for w, fan_in in ((self.router_weight, self.hidden_size),
                              (self.fc1_weight, self.hidden_size),
                              (self.fc2_weight, self.ffn_hidden_size)):
                bound = 1.0 / math.sqrt(fan_in)
                w.uniform_(-bound, bound)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            if self.shared_experts is not None:
                self.shared_experts.reset_parameters()

    def set_loss_scale(self, scale: Union[float, torch.Tensor]) -> None:
        """The gradient the auxiliary losses receive in backward (Megatron
        sets the main loss scale / number of micro-batches). In place on the
        device: a captured CUDA graph sees the new value."""
        if isinstance(scale, torch.Tensor):
            self.loss_scale.copy_(scale.detach().reshape(()))
        else:
            self.loss_scale.fill_(float(scale))

    def _route(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor],
               cu_seqlens: Optional[torch.Tensor], impl=ops):
        with_losses = self.training and torch.is_grad_enabled()
        seq = self.seq_aux_loss_coeff if with_losses else 0.0
        return impl.router(
            logits, self.topk, score_function=self.score_function,
            pre_softmax=self.pre_softmax, num_groups=self.num_groups,
            group_topk=self.group_topk, topk_scaling_factor=self.topk_scaling_factor,
            expert_bias=self.expert_bias,
            aux_loss_coeff=self.aux_loss_coeff if with_losses else 0.0,
            z_loss_coeff=self.z_loss_coeff if with_losses else 0.0,
            seq_aux_loss_coeff=seq, padding_mask=padding_mask,
            cu_seqlens=cu_seqlens if seq else None)

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        st = self._side_streams.get(device)
        if st is None:
            st = self._side_streams[device] = torch.cuda.Stream(device=device)
        return st

    def _sequences(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]):
        """cu_seqlens [S+1] int32 on x's device, for the per-sequence loss."""
        if cu_seqlens is not None:
            if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
                raise ValueError(f"cu_seqlens must be [S+1] int32 with S >= 1, got shape "
                                 f"{tuple(cu_seqlens.shape)}")
            if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != x.device:
                raise ValueError(f"cu_seqlens must be int32 on {x.device}, got "
                                 f"{cu_seqlens.dtype} on {cu_seqlens.device}")
            return cu_seqlens
        # [B, S, H]: B sequences of S tokens; [T, H]: one sequence.
        B, L = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.numel() // x.shape[-1])
        return torch.arange(B + 1, dtype=torch.int32, device=x.device) * L

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H] -> out [..., H] in x's dtype (the experts compute in
        ``params_dtype``). ``padding_mask`` (x's leading shape, bool, True:
        padding): those tokens go to no expert (their output is the shared
        expert's, or zero) and stay out of the losses and counts.
        ``cu_seqlens`` ([S+1] int32, packed sequences) for the per-sequence
        aux loss; without it a [B, S, H] input is B sequences of S tokens and
        a [T, H] input one sequence.

        Under ``torch.compile`` the layer joins the graph through torch
        custom operators (``fullgraph=True`` works), or where its
        configuration has none (FP8, ``ep_group``, delayed or fused weight
        gradients) runs eagerly as one unit: one graph break (docs/python.md, "torch.compile")."""
        if torch.compiler.is_compiling():
            if _compiled.unsupported(self) is None:
                return self._forward(x, padding_mask, cu_seqlens, _compiled)
            # One break here instead of one per op (torch._dynamo is loaded by then).
            return torch.compiler.disable(MoELayer._forward)(self, x, padding_mask, cu_seqlens)
        return self._forward(x, padding_mask, cu_seqlens)

    def _forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor],
                 cu_seqlens: Optional[torch.Tensor], traced=None) -> torch.Tensor:
        # traced: the _compiled module while Dynamo traces (its custom
        # operators stand for moeflow.ops), else None
        impl = ops if traced is None else traced
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., {self.hidden_size}], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        mask = None
        if padding_mask is not None:
            if tuple(padding_mask.shape) != tuple(shape[:-1]):
                raise ValueError(f"padding_mask must have x's leading shape {tuple(shape[:-1])}, "
                                 f"got {tuple(padding_mask.shape)}")
            if padding_mask.device != x.device:
                raise ValueError(f"padding_mask must be on {x.device}, got {padding_mask.device}")
            mask = padding_mask.reshape(-1)
            if mask.dtype != torch.bool:
                mask = mask != 0
        cu = self._sequences(x, cu_seqlens) if self.seq_aux_loss_coeff else None
        xe = x2.to(self.fc1_weight.dtype)
        shared, side = None, None
        if self.shared_experts is not None:
            if self.shared_expert_overlap and xe.is_cuda and traced is None:
                # The shared expert on a side stream, beside the routed path
                # (its backward runs on that stream too).
                main = torch.cuda.current_stream(xe.device)
                side = self._side_stream(xe.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    shared = self.shared_experts(xe, self)
                xe.record_stream(side)
            else:
                shared = self.shared_experts(xe, self)

        logits = impl.router_logits(x2, self.router_weight)  # [T, E] float32
        routed = self._route(logits, mask, cu, impl)
        probs = routed.probs
        E = self.num_experts
        for i, loss in enumerate((routed.aux_loss, routed.z_loss, routed.seq_aux_loss)):
            if loss is not None:
                probs = MoEAuxLossAutoScaler.apply(probs, loss, self.loss_scale)
                self._loss_stats[i].copy_(loss.detach())
        self._stats[E:E + 1].copy_(routed.nonfinite)
        ids, tpe = routed.topk_ids, routed.tokens_per_expert
        if self.capacity_factor is not None:
            ids, dropped = impl.apply_capacity(ids, routed.probs.detach(), E,
                                               self.capacity_factor, self.token_drop_policy)
            self._stats[E + 1:].copy_(dropped)
            # What each expert keeps, min(count, capacity): the counts the
            # bias and the logs see, as Megatron counts the dropped routing map.
            tpe = torch.clamp(tpe, max=expert_capacity(ids.shape[0], self.topk, E,
                                                       self.capacity_factor))
        self._stats[:E].copy_(tpe)
        if self.use_expert_bias and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                if self.local_tokens_per_expert is not None:
                    self.local_tokens_per_expert.add_(tpe)
                else:
                    impl.update_expert_bias(tpe, self.expert_bias, self.expert_bias_update_rate)

        if self.ep_group is not None:
            out = self._experts_ep(xe, ids, probs)
        elif traced is not None:
            out = traced.experts(xe, ids, probs, self.fc1_weight, self.fc2_weight, None, None,
                                 self.num_experts, self.align, self._mlp_cfg())
        else:
            out = self._experts(xe, ids, probs)
        if shared is not None:
            if side is not None:
                torch.cuda.current_stream(xe.device).wait_stream(side)
                shared.record_stream(torch.cuda.current_stream(xe.device))
            out = out + shared
        return out.to(x.dtype).reshape(shape)

    def _mlp_cfg(self) -> tuple:
        """The MLP's activation: (name, GLU interleave, alpha, limit, offset)."""
        return (self.activation, int(self.glu_interleave), float(self.activation_alpha),
                float(self.activation_limit), float(self.activation_offset))

    def _mlp(self, rows: torch.Tensor, **groups) -> torch.Tensor:
        """The grouped expert MLP of the local experts over ``rows``, its
        groups given by ``groups`` (ops.grouped_mlp's plan / offsets ...)."""
        return ops.grouped_mlp(rows, self.fc1_weight, self.fc2_weight,
                               activation=self.activation, glu_interleave=self.glu_interleave,
                               alpha=self.activation_alpha, limit=self.activation_limit,
                               offset=self.activation_offset,
                               accumulate_into_main_grad=self.gradient_accumulation_fusion,
                               accumulate_into_grad=self.accumulate_into_grad,
                               recompute_activation=self.recompute_activation,
                               recompute_permute=self.recompute_permute,
                               wgrad_store=self._wgrad_store, precision=self.precision,
                               fp8_weight_cache=self.fp8_weight_cache,
                               fp8_wgrad=self.fp8_wgrad,
                               align=None if "plan" in groups else self._groups_align, **groups)

    def _experts_ep(self, xe: torch.Tensor, ids: torch.Tensor,
                    probs: torch.Tensor) -> torch.Tensor:
        """The routed experts across the ranks: dispatch, the local experts'
        MLP, combine weighted by probs. [T, H] -> [T, H]."""
        if self.precision == "bf16":
            # Dispatch, MLP and combine in one autograd node: its backward
            # frees each rows' gradient as soon as it is read.
            xin, args = _ep._prepare_dispatch(xe, ids, probs, self.ep_group, None)
            out = self._mlp(xin, probs=probs, _ep=args)
            self.last_ep_overflow = args[3].overflow.clone()
            return out
        if self.ep_group.dtype in _ep._FP8:
            # FP8 on the wire: the MLP's node dispatches the tokens as their
            # 1x128 codes (quantized by the dispatch) and reads them as FC1's
            # input; its backward returns the tokens' gradient through the
            # dispatch's. The combine follows, weighted by the probs.
            _, args = _ep._prepare_dispatch(xe.detach(), ids, probs, self.ep_group, None)
            y = self._mlp(xe.contiguous(), _ep=args)
            self.last_ep_overflow = args[3].overflow.clone()
            return _ep.combine(y, args[3], probs)
        rows, tpe, offsets, handle = _ep.dispatch(xe, ids, probs, self.ep_group)
        self.last_ep_overflow = handle.overflow.clone()
        y = self._mlp(rows, offsets=offsets, real_rows=tpe)
        return _ep.combine(y, handle, probs)

    def _experts(self, xe: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The routed experts on this device: permute, MLP, unpermute."""
        plan = ops.Plan(ids, self.num_experts, self.align)
        # Permute, MLP and unpermute in one autograd node: its backward frees
        # each rows' gradient as soon as it is read.
        return self._mlp(xe, plan=plan, probs=probs, permute=True, unpermute=True)

    @property
    def last_tokens_per_expert(self) -> torch.Tensor:
        """[E] int32: the last forward's slots per expert (the slots kept,
        with capacity_factor). A view the next forward overwrites."""
        return self._stats[:self.num_experts]

    @property
    def last_nonfinite(self) -> torch.Tensor:
        """[1] int32: the last forward's tokens with a NaN / inf router logit."""
        return self._stats[self.num_experts:self.num_experts + 1]

    @property
    def last_dropped(self) -> Optional[torch.Tensor]:
        """[1] int32: the slots the last forward dropped (None without
        capacity_factor)."""
        return None if self.capacity_factor is None else self._stats[self.num_experts + 1:]

    @property
    def last_losses(self) -> Dict[str, torch.Tensor]:
        """The auxiliary losses of the last training forward with autograd
        on, coefficients included ({} in eval mode; zeros before the first):
        0-dim float32 views the next such forward overwrites."""
        if not self.training:
            return {}
        coeff = (self.aux_loss_coeff, self.z_loss_coeff, self.seq_aux_loss_coeff)
        return {name: self._loss_stats[i] for i, name in enumerate(_LOSSES) if coeff[i]}

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Optional[torch.Tensor] = None) -> None:
        """With ``expert_bias_update="step"``: one balancing step from the
        counts the training forwards accumulated since the last call
        (``local_tokens_per_expert``, or ``tokens_per_expert`` when given, e.g.
        those counts all-reduced over the data-parallel ranks), then the
        counts restart from zero. On the device, no sync."""
        if not self.use_expert_bias or self.local_tokens_per_expert is None:
            raise RuntimeError("update_expert_bias needs use_expert_bias=True and "
                               "expert_bias_update='step'")
        tpe = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        ops.update_expert_bias(tpe.to(torch.int32), self.expert_bias,
                               self.expert_bias_update_rate)
        self.local_tokens_per_expert.zero_()

    def backward_dw(self) -> None:
        """With ``delay_wgrad_compute``: computes the expert weight gradients
        of the backward passes run since the last call (routed and shared
        experts), adding them into ``.grad`` (or ``main_grad``). The input
        and router gradients come from backward itself. Without it: nothing
        to do."""
        if self._wgrad_store is not None:
            self._wgrad_store.run()

    def extra_repr(self) -> str:
        s = (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
             f"num_experts={self.num_experts}, topk={self.topk}, activation={self.activation!r}, "
             f"score_function={self.score_function!r}, params_dtype={self.fc1_weight.dtype}")
        if self.glu_interleave:
            s += f", glu_interleave={self.glu_interleave}"
        if self.pre_softmax:
            s += ", pre_softmax=True"
        if self.num_groups:
            s += f", num_groups={self.num_groups}, group_topk={self.group_topk}"
        if self.topk_scaling_factor:
            s += f", topk_scaling_factor={self.topk_scaling_factor}"
        if self.use_expert_bias:
            s += f", use_expert_bias=True, expert_bias_update_rate={self.expert_bias_update_rate}"
        if self.aux_loss_coeff:
            s += f", aux_loss_coeff={self.aux_loss_coeff}"
        if self.seq_aux_loss_coeff:
            s += f", seq_aux_loss_coeff={self.seq_aux_loss_coeff}"
        if self.capacity_factor is not None:
            s += (f", capacity_factor={self.capacity_factor}, "
                  f"token_drop_policy={self.token_drop_policy!r}")
        if self.z_loss_coeff:
            s += f", z_loss_coeff={self.z_loss_coeff}"
        if self.ep_group is not None:
            s += (f", ep_group=({self.ep_group.backend!r}, rank {self.ep_group.rank} of "
                  f"{self.ep_group.world_size}, experts {self.expert_range})")
        if self.shared_experts is not None:
            s += f", shared_expert_ffn_hidden_size={self.shared_experts.ffn_hidden_size}"
        if self.delay_wgrad_compute:
            s += ", delay_wgrad_compute=True"
        if not self.recompute_activation:
            s += ", recompute_activation=False"
        if not self.recompute_permute:
            s += ", recompute_permute=False"
        if self.precision != "bf16":
            s += f", precision={self.precision!r}"
        if self.fp8_wgrad:
            s += ", fp8_wgrad=True"
        return s
