"""Megatron-Core's expert-parallel MoE layer as a peer of ``moeflow.MoELayer``
(used by bench/py_layer_ep.py), without TransformerEngine or apex.

The layer is megatron-core's own ``MoELayer``: ``TopKRouter`` (router GEMM
and routing in float32, ``moe_router_dtype="fp32"``), the ``"alltoall"``
token dispatcher (unfused permute: the fused one is TransformerEngine's) and
one of two expert modules:

- ``"grouped"`` (the default): megatron's grouped experts class
  ``TEGroupedMLP`` (its unfused path: FC1, the weighted SwiGLU of
  ``bias_activation_fusion`` or plain torch ops, FC2) with
  :class:`TorchGroupedLinear` as its ``linear_fc1`` / ``linear_fc2``: one
  ``torch._grouped_mm`` per GEMM over a stacked [experts, out, in] weight.
  Without TransformerEngine megatron-core 0.19 has no grouped-GEMM expert
  linear of its own (the ``grouped_gemm`` package's GroupedMLP is gone, its
  torch grouped_mm path is inference-only), so this is the best torch-only
  form of megatron's training experts.
- ``"sequential"``: ``SequentialMLP``, megatron's experts without
  TransformerEngine (one ``MLP`` of ColumnParallelLinear / RowParallelLinear
  per local expert, run one after the other).

Install (no network; torch, numpy and packaging present):

    python3 -m pip install --no-deps --no-index --target /tmp/mcore \\
        .wheels/megatron_core-0.19.2-*.whl
    # or, without pip: python3 -m zipfile -e .wheels/megatron_core-0.19.2-*.whl /tmp/mcore

then ``PYTHONPATH=/tmp/mcore`` or ``--mcore-path /tmp/mcore``.
"""
import functools
import itertools
import os
import sys
import warnings

import torch
import torch.nn.functional as F

EXPERTS = ("grouped", "sequential")
EXPERTS_DESC = {
    "grouped": "TEGroupedMLP (megatron's grouped experts class) with torch._grouped_mm "
               "linear_fc1/linear_fc2 (no TransformerEngine)",
    "sequential": "SequentialMLP (one ColumnParallelLinear/RowParallelLinear MLP per expert)",
}

_state = {"initialised": False}


def import_megatron(path=None):
    """(megatron-core's version, None) or (None, the reason it is not
    importable). ``path``: a folder to put first on sys.path (an unpacked
    wheel)."""
    if path:
        path = os.path.abspath(path)
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.setdefault("NO_VCS_VERSION", "1")  # package_info would ask git otherwise
    try:
        with warnings.catch_warnings():
            # "TransformerEngine / apex not installed, falling back": expected here.
            warnings.simplefilter("ignore")
            from megatron.core import package_info
            from megatron.core import parallel_state, tensor_parallel  # noqa: F401
            from megatron.core.transformer.moe import experts, moe_layer  # noqa: F401
            from megatron.core.transformer import transformer_config  # noqa: F401
    except Exception as e:  # ImportError, or a version mismatch inside megatron
        return None, f"{type(e).__name__}: {e}"
    return package_info.__shortversion__, None


class TorchGroupedLinear(torch.nn.Module):
    """Megatron's grouped-linear interface (experts.GroupedLinearFc1Builder /
    Fc2Builder: ``forward(x, tokens_per_expert: list[int]) -> (y, None)``,
    ``backward_dw()``) on ``torch._grouped_mm``.

    ``weight`` [num_gemms, output_size, input_size] (params_dtype): one
    parameter, so the GEMM needs no stacking copy; x [M, input_size] with
    the rows of expert e at offsets [sum(tpe[:e]), sum(tpe[:e+1])) ->
    y [M, output_size]. The weight gradient comes from autograd (plain
    ``.grad``)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection, name=None):
        super().__init__()
        if bias:
            raise ValueError("TorchGroupedLinear has no bias (set add_bias_linear=False)")
        if pg_collection is not None and pg_collection.expt_tp.size() != 1:
            raise ValueError("TorchGroupedLinear supports expert tensor parallel size 1 only, "
                             f"got {pg_collection.expt_tp.size()}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.weight = torch.nn.Parameter(torch.empty(
            (num_gemms, output_size, input_size), dtype=config.params_dtype,
            device=torch.cuda.current_device()))
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)  # normal_(0, std): elementwise, any shape

    def forward(self, x, tokens_per_expert):
        # The offsets' host values are known (megatron passes a list): one small
        # host-to-device copy, the same for FC1 and FC2.
        ends = list(itertools.accumulate(int(n) for n in tokens_per_expert))
        offs = torch.tensor(ends, dtype=torch.int32).to(x.device, non_blocking=True)
        y = torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offs)
        return y, None

    def backward_dw(self):
        pass  # weight gradients are computed in backward


def setup(world_size, seed, timeout_min):
    """Megatron's parallel state for expert parallelism over every rank
    (TP = PP = CP = 1, EP = world size; attention data-parallel over the
    same ranks) and its CUDA RNG trackers (SequentialMLP's initialisation
    forks the expert tracker). Once per process, after
    torch.distributed.init_process_group and torch.cuda.set_device."""
    if _state["initialised"]:
        return
    from megatron.core import parallel_state, tensor_parallel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=world_size, expert_tensor_parallel_size=1,
            create_gloo_process_groups=False, distributed_timeout_minutes=timeout_min)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _state["initialised"] = True


def make_config(H, Fd, E, K, router, world_size, aux_loss_coeff, act_fusion,
                experts="grouped"):
    """megatron's TransformerConfig for one MoE layer: bf16, SwiGLU experts
    (gated_linear_unit + silu, no bias), float32 routing, alltoall dispatch,
    no TransformerEngine fusions. ``router``: the case's moeflow router
    options (score_function, num_groups, group_topk, use_expert_bias,
    topk_scaling_factor)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=Fd,
        moe_ffn_hidden_size=Fd, num_moe_experts=E, moe_router_topk=K,
        moe_router_score_function=router.get("score_function", "softmax"),
        moe_router_num_groups=router.get("num_groups") or None,
        moe_router_group_topk=router.get("group_topk") or None,
        moe_router_enable_expert_bias=bool(router.get("use_expert_bias", False)),
        moe_router_topk_scaling_factor=router.get("topk_scaling_factor"),
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
        moe_router_fusion=False, moe_grouped_gemm=experts == "grouped",
        expert_model_parallel_size=world_size, expert_tensor_parallel_size=1,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=act_fusion,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        sequence_parallel=False, gradient_accumulation_fusion=False)


def build_layer(config, experts="grouped"):
    """megatron's MoELayer on the current CUDA device, in training mode.
    Forward: x [S, B, H] bf16 -> (out [S, B, H], None)."""
    from megatron.core.transformer.moe.experts import (GroupedMLPSubmodules, SequentialMLP,
                                                       TEGroupedMLP)
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    if experts == "grouped":
        builder = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear))
    elif experts == "sequential":
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        builder = functools.partial(SequentialMLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    else:
        raise ValueError(f"experts must be one of {EXPERTS}, got {experts!r}")
    layer = MoELayer(config, submodules=MoESubmodules(experts=builder))
    # The router's weight is created on the host (megatron moves it on first use):
    # move everything now so the step's memory counts no weight copy.
    layer.cuda()
    layer.train()
    return layer


def router_weight(layer):
    """The router's [E, H] weight parameter (params_dtype; megatron computes
    the logits in float32 with moe_router_dtype='fp32')."""
    return layer.router.weight
