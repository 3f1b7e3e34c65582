"""Helpers shared by moeflow.ops and its op modules: the current stream's
address, the torch names of the hot paths as module globals, memoised shape
queries to the C++ side."""
from __future__ import annotations

import functools
import os
import warnings

import torch

from . import _C

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: torch.Tensor) -> int:
    """The address of torch's current stream on t's device (0 on the CPU)."""
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:  # no Stream object made: the op's hot path
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _load_nodes():
    """moeflow._autograd, the C++ autograd nodes (plan build, permute,
    unpermute, router; the grouped MLP's forward call), or None: not built (no torch at build time), or turned off
    with MOEFLOW_TORCH_NODES=0. The ops then use their Python nodes, with
    the same results bit for bit."""
    if os.environ.get("MOEFLOW_TORCH_NODES", "1") == "0":
        return None
    try:
        from . import _autograd
    except ModuleNotFoundError:
        return None
    except ImportError as e:  # built, but not loadable with this torch
        warnings.warn(f"moeflow: the C++ autograd nodes do not load ({e}); using the Python "
                      "ones (rebuild moeflow against this torch)", RuntimeWarning)
        return None
    if _autograd.torch_version != torch.__version__:  # torch's C++ ABI is per version
        warnings.warn(f"moeflow: the C++ autograd nodes were built against torch "
                      f"{_autograd.torch_version}, this is {torch.__version__}; using the "
                      "Python ones (rebuild moeflow against this torch)", RuntimeWarning)
        return None
    return _autograd


_nodes = _load_nodes()


# The hot paths' torch names as module globals. An op whose inputs need no
# gradient (grad mode off, or none requiring grad) calls its Function's
# forward with ctx None: the same outputs without the autograd node, whose
# apply() is most of an op's host time.
_grad_enabled = torch.is_grad_enabled
_empty = torch.empty
_int32, _int64, _float32, _uint8 = torch.int32, torch.int64, torch.float32, torch.uint8
_tuple_new = tuple.__new__


# Shape-only queries to the C++ side (pure functions of their arguments),
# memoised so that an op's hot path makes no extra C++ call.
_router_ws_bytes = functools.lru_cache(maxsize=256)(lambda *a: _C.router_workspace_bytes(*a))
# (capacity_rows, workspace bytes, the int64 buffer's parts, the int32
# buffer's parts) of a moeflow.Plan (python/src/plan_buffers.h states the layout)
_plan_sizes = functools.lru_cache(maxsize=256)(
    lambda *a: tuple(tuple(v) if isinstance(v, list) else v for v in _C.plan_buffer_layout(*a)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its rows have unit-stride elements, else a copy
    (an empty one: a fresh tensor, since torch calls an empty tensor
    contiguous whatever its strides, e.g. the [0, 0] of an expanded grad)."""
    if t.dim() and t.stride(-1) == 1:
        return t
    if t.numel() == 0:
        return t.new_empty(t.shape)
    return t if t.is_contiguous() else t.contiguous()


_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def _grad_into(ctx, index: int):
    """The ``.grad`` that a backward may add input ``index``'s gradient into
    in place (its wgrad GEMM with accumulate, returning None for the input),
    or None to return the gradient as usual. ``index`` counts the forward's
    tensor inputs. Only where autograd would do the same ``p.grad += g`` in
    place: ``p`` a leaf still requiring grad, with a dense contiguous
    16-byte aligned ``.grad`` of its dtype and shape, no tensor hooks, no
    post-accumulate hooks, no ``create_graph``, the engine about to run p's
    AccumulateGrad node (``.backward()``, not ``autograd.grad`` nor
    ``backward(inputs=...)`` without p), and on CUDA the default stream
    (the engine orders no stream after a gradient that is not returned)."""
    if _will_execute is None or _grad_enabled():
        return None
    node = ctx.next_functions[index][0]
    p = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
    if p is None or not p.requires_grad:
        return None
    g = p.grad
    if (g is None or type(g) is not torch.Tensor or g.requires_grad or g.dtype != p.dtype
            or g.shape != p.shape or g.device != p.device or g.layout != torch.strided
            or not g.is_contiguous() or g.data_ptr() % 16 or p._backward_hooks
            or getattr(p, "_post_accumulate_grad_hooks", None)):
        return None
    if g.is_cuda and _stream(g) != torch.cuda.default_stream(g.device).cuda_stream:
        return None
    try:
        if not _will_execute(node):
            return None
    except RuntimeError:  # a leaf under autograd.grad: the gradient is returned
        return None
    return g


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _may_drop_early() -> bool:
    """In a forward: whether its node may keep tensors it made itself as
    attributes rather than saved tensors, for its backward to drop once read
    for the last time (so the rest of the backward does not hold them). Only
    when no saved-tensor hook is active (activation checkpointing and
    offloading must see every saved tensor) and this torch can tell a
    backward that may run again (_backward_owns)."""
    if _keep_graph is None or _top_hooks is None:
        return False
    try:
        return _top_hooks(False) is None
    except TypeError:  # another signature: keep the tensors saved
        return False


def _backward_owns() -> bool:
    """In a backward: whether it may drop what its forward kept for it: the
    graph cannot run again (neither retain_graph nor create_graph)."""
    return not _keep_graph()


def _take_held(ctx, saved) -> list:
    """In a backward: what its forward held for it (``ctx.held``, where
    _may_drop_early allowed) or else the same tensors as saved (``saved``),
    as a list that the backward sets to None entry by entry once read for
    the last time: that frees them where the backward holds the only
    references (_backward_owns; the node then lets go of its own)."""
    held = ctx.held
    if held is None:
        return list(saved)  # saved tensors: autograd holds them to the end
    if _backward_owns():
        ctx.held = None
        return held
    return list(held)  # retain_graph / create_graph: the node keeps its own
