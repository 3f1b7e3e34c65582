"""moeflow as a backend of Megatron-Core's flex token dispatcher (0.19).

    import moeflow.megatron
    moeflow.megatron.install(backend="nccl")          # once per process, before the model
    config = TransformerConfig(..., moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend="moeflow")

:func:`install` teaches megatron-core's ``MoEFlexTokenDispatcher`` a new
``moe_flex_dispatcher_backend`` value (``"moeflow"`` unless told otherwise)
whose communication manager is :class:`MoeflowDispatchManager`: the
``_DispatchManager`` interface of the DeepEP / HybridEP / NCCL-EP managers
over :mod:`moeflow.ep`. Every other backend value keeps megatron's own code.

The token path of one MoE layer (T tokens on this rank, W ranks of the
dispatcher's TPxEP group, L local experts, K slots per token):

- ``setup_metadata(routing_map [T, W, L] bool, probs [T, W, L])``: the
  routed experts as topk ids [T, K] (ascending expert id, -1 for slots the
  router dropped) and their probabilities [T, K] float32, gathered from
  ``probs`` (differentiable). Device ops only.
- ``dispatch(x [T, H])``: :func:`moeflow.ep.dispatch`: the rows of the local
  experts [capacity, H], already permuted by local expert and padded to
  ``align`` rows (pad rows zero).
- ``get_permuted_hidden_states_by_experts``: megatron's experts take host
  split sizes (``tokens_per_expert.tolist()``, ``torch.split``): the L + 1
  row offsets are copied to the host once (the one host synchronisation of
  the layer that moeflow adds) and the rows narrowed to the used ones
  (a view). ``tokens_per_expert`` [L] is a CPU int64 tensor of the padded
  segment lengths (pad rows included, like HybridEP / NCCL-EP with
  alignment), so the experts' own ``.tolist()`` costs nothing. With
  ``static_shape=True`` (experts that read device counts: the
  TransformerEngine op-fuser grouped MLP) nothing is copied: the whole
  receive buffer and device counts go to the experts.
- The experts get ``permuted_probs`` of ones and ``combine`` weights each
  slot by its probability (moeflow's fused float32 combine, whose backward
  gives the probabilities' gradient). Megatron's experts scale their
  activation (and their FC2 bias) by ``permuted_probs``: their output is
  linear in it, so this is the same function with the same gradients
  (``moe_apply_probs_on_input``, which scales the input, is refused).
- ``get_restored_hidden_states_by_experts``: the experts' [n, H] output put
  back into a [capacity, H] buffer (one copy of the n rows; none with
  ``static_shape``). ``combine``: :func:`moeflow.ep.combine` -> [T, H].

Groups: one :class:`moeflow.ep.Group` per (process group, shapes, dtype),
shared by every MoE layer, made on the first dispatch (a collective: every
rank reaches it together). See docs/megatron.md.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from . import ep

__all__ = ["install", "uninstall", "installed", "make_group", "destroy_groups",
           "MoeflowDispatchManager"]

_settings = None  # the installed options (_Settings), None when not installed
_orig_flex_init = None
_groups = {}  # (process group, E, K, H, dtype, backend, align, max T, capacity) -> ep.Group
# Tests set this: rows of the capacity buffers that hold no data become NaN
# instead of uninitialised memory, so that a read of them shows.
_poison_unused_rows = False


class _Settings:
    __slots__ = ("name", "backend", "max_tokens_per_rank", "capacity_factor", "align",
                 "static_shape", "timeout", "options")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _import_megatron():
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except Exception as e:  # ImportError, or megatron's own import errors
        raise ImportError(f"moeflow.megatron needs megatron-core (0.19), which is not "
                          f"importable here: {type(e).__name__}: {e}") from e
    return token_dispatcher


def install(name: str = "moeflow", *, backend: Optional[str] = None,
            max_tokens_per_rank: Optional[int] = None, capacity_factor: Optional[float] = None,
            align: Optional[int] = None, static_shape: bool = False, timeout: float = 300.0,
            **options) -> None:
    """Registers moeflow as ``moe_flex_dispatcher_backend=name`` of megatron-core's
    ``MoEFlexTokenDispatcher`` (every process, before the MoE layers are built).

    ``name``: the backend value that selects moeflow; an existing one
    ("deepep", "hybridep", "ncclep") is taken over, for launchers whose
    command line accepts only those. ``backend``: moeflow's EP backend
    ("nccl", "nvlink" or "reference"; None: "nccl" for CUDA tokens, else
    "reference"). ``max_tokens_per_rank``: the most tokens a rank dispatches
    per layer call (sequence x micro-batch / TP / CP); None: the largest of
    the ranks' first dispatch (one all-reduce, once); a later dispatch with
    more raises. ``capacity_factor``: receive rows per rank =
    ceil(max_tokens_per_rank x K x factor) rounded up to align, slots past it
    dropped and flagged in the manager's ``over_budget`` (megatron's
    ``check_over_budget()``); None: the worst case, nothing dropped.
    ``align``: rows per local expert padded to a multiple of it (1, 16, 32,
    64, 128, 256; None: megatron's quantization alignment when it has one,
    else 1). ``static_shape``: hand the experts the whole receive buffer and
    device counts (no host copy; needs experts that read device counts:
    use_transformer_engine_op_fuser and moe_grouped_gemm). ``timeout``
    (seconds) and ``options`` (EpOptions fields, docs/tuning.md) go to
    :class:`moeflow.ep.Group`.

    Installing again replaces the options (groups made so far are kept)."""
    global _settings, _orig_flex_init
    if backend is not None and backend not in ep._BACKENDS:
        raise ValueError(f"backend must be one of {ep._BACKENDS} or None, got {backend!r}")
    if align is not None and int(align) not in ep._ALIGNS:
        raise ValueError(f"align must be one of {ep._ALIGNS} or None, got {align}")
    if max_tokens_per_rank is not None and int(max_tokens_per_rank) <= 0:
        raise ValueError(f"max_tokens_per_rank must be > 0 or None, got {max_tokens_per_rank}")
    if capacity_factor is not None and not float(capacity_factor) > 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    td = _import_megatron()
    _settings = _Settings(name=name, backend=backend,
                          max_tokens_per_rank=None if max_tokens_per_rank is None
                          else int(max_tokens_per_rank),
                          capacity_factor=None if capacity_factor is None
                          else float(capacity_factor),
                          align=None if align is None else int(align),
                          static_shape=bool(static_shape), timeout=float(timeout),
                          options=dict(options))
    if _orig_flex_init is None:
        _orig_flex_init = td.MoEFlexTokenDispatcher.__init__
        td.MoEFlexTokenDispatcher.__init__ = _flex_init
        td._DispatchManager.register(MoeflowDispatchManager)


def uninstall() -> None:
    """Gives megatron-core's flex dispatcher its own constructor back (layers
    built meanwhile keep their manager). Groups stay: :func:`destroy_groups`."""
    global _settings, _orig_flex_init
    if _orig_flex_init is not None:
        td = _import_megatron()
        td.MoEFlexTokenDispatcher.__init__ = _orig_flex_init
        _orig_flex_init = None
    _settings = None


def installed() -> Optional[str]:
    """The backend name that selects moeflow, None when not installed."""
    return None if _settings is None else _settings.name


def destroy_groups() -> None:
    """Releases every group made for megatron (every rank together, once no
    dispatch of them is in flight)."""
    for g in _groups.values():
        g.destroy()
    _groups.clear()


def _flex_init(self, num_local_experts, local_expert_indices, config, pg_collection=None):
    s = _settings
    if s is None or config.moe_flex_dispatcher_backend != s.name:
        return _orig_flex_init(self, num_local_experts, local_expert_indices, config,
                               pg_collection)
    td = _import_megatron()
    td.MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
    self.num_local_experts = num_local_experts
    self.local_expert_indices = local_expert_indices
    # The flex dispatcher's one group over TP x EP: each (expert, TP rank) is
    # an expert of its own, every token sent to the TP ranks of its experts.
    self._comm_manager = MoeflowDispatchManager(
        group=self.tp_ep_group, num_local_experts=num_local_experts,
        router_topk=self.tp_size * config.moe_router_topk,
        num_experts=self.tp_size * config.num_moe_experts, config=config, settings=s)
    self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]


def _default_align(config) -> int:
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    a = int(get_align_size_for_quantization(config) or 1)
    if a not in ep._ALIGNS:
        raise ValueError(f"megatron's quantization alignment {a} is not one moeflow pads to "
                         f"{ep._ALIGNS}; pass align= to moeflow.megatron.install")
    return a


def make_group(process_group, *, num_experts: int, topk: int, hidden_size: int,
               dtype: torch.dtype, max_tokens_per_rank: int, backend: str = "nccl",
               align: int = 1, capacity_factor: Optional[float] = None,
               timeout: float = 300.0, **options) -> ep.Group:
    """The shared :class:`moeflow.ep.Group` of these arguments over
    ``process_group`` (None: megatron's expert tensor-and-model-parallel
    group, ``parallel_state.get_expert_tensor_and_model_parallel_group()``,
    which is the EP group when expert TP is 1). Made on the first call (a
    collective: every rank of the group calls it together), then reused."""
    if process_group is None:
        from megatron.core import parallel_state
        process_group = parallel_state.get_expert_tensor_and_model_parallel_group()
    cap = -1
    if capacity_factor is not None:
        cap = math.ceil(max_tokens_per_rank * topk * capacity_factor)
        cap = (cap + align - 1) // align * align
    key = (process_group, num_experts, topk, hidden_size, dtype, backend, align,
           max_tokens_per_rank, cap)
    g = _groups.get(key)
    if g is None:
        g = ep.Group(process_group, num_experts=num_experts, topk=topk, hidden_size=hidden_size,
                     dtype=dtype, backend=backend, max_tokens_per_rank=max_tokens_per_rank,
                     align=align, capacity_rows=cap, timeout=timeout, **options)
        _groups[key] = g
    return g


# ---------------------------------------------------------------------------
# Narrowing to the used rows and back, without touching the unused capacity.

def _unused(shape, like: torch.Tensor) -> torch.Tensor:
    if _poison_unused_rows and like.is_floating_point():
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    return like.new_empty(shape)


class _Narrow(torch.autograd.Function):
    """rows [capacity, H] -> rows[:n] (a view); backward: the gradient in a
    [capacity, H] buffer whose rows past n are not written (dispatch's
    backward reads only the slots' rows)."""

    @staticmethod
    def forward(ctx, rows, n):
        ctx.cap = rows.shape[0]
        return rows[:n]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        full = _unused((ctx.cap, *grad.shape[1:]), grad)
        full[:grad.shape[0]].copy_(grad)
        return full, None


class _ToCapacity(torch.autograd.Function):
    """y [n, H] -> [capacity, H], y in the first n rows, the rest not written
    (combine reads only the slots' rows); backward: the first n rows."""

    @staticmethod
    def forward(ctx, y, cap):
        full = _unused((cap, *y.shape[1:]), y)
        full[:y.shape[0]].copy_(y)
        ctx.n = y.shape[0]
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[:ctx.n], None


class MoeflowDispatchManager:
    """Megatron-Core's ``_DispatchManager`` interface over :mod:`moeflow.ep`
    (made by the flex dispatcher once :func:`install` ran; see the module
    doc for what each step does). Per-call state lives between a dispatch
    and its combine; the way back of each dispatch is in its
    :class:`moeflow.ep.EpHandle`, held by autograd, so several layers and
    micro-batches can be in flight and recomputation makes its own."""

    def __init__(self, group, num_local_experts: int, router_topk: int, num_experts: int,
                 config, settings: Optional[_Settings] = None):
        s = settings if settings is not None else _settings
        if s is None:
            raise RuntimeError("moeflow.megatron.install() has not been called")
        if config.moe_apply_probs_on_input:
            raise ValueError("the moeflow flex backend weights the expert outputs in combine; "
                             "moe_apply_probs_on_input (probs applied before FC1) is not "
                             "linear in the probs: unsupported")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("the moeflow flex backend does not pad experts to capacity "
                             "(moe_pad_expert_input_to_capacity); use install(capacity_factor=) "
                             "for a receive budget per rank")
        W = dist.get_world_size(group)
        if num_experts != W * num_local_experts:
            raise ValueError(f"num_experts={num_experts} must be the group size {W} x "
                             f"num_local_experts={num_local_experts}")
        if s.static_shape and not (config.use_transformer_engine_op_fuser
                                   and config.moe_grouped_gemm):
            raise ValueError("install(static_shape=True) needs experts that read device "
                             "counts: use_transformer_engine_op_fuser and moe_grouped_gemm")
        self.group, self.config, self.settings = group, config, s
        self.num_local_experts, self.num_experts = num_local_experts, num_experts
        self.router_topk = router_topk
        self.hidden_size = config.moe_latent_size or config.hidden_size
        self.align = s.align if s.align is not None else _default_align(config)
        self.static_shape = s.static_shape
        # Slots dropped for want of receive rows (capacity_factor), accumulated
        # on the device like HybridEP's: MoEFlexTokenDispatcher.check_over_budget().
        # Moved to the tokens' device at the first dispatch (_group_for).
        self.over_budget = torch.zeros(1, dtype=torch.bool)
        self.token_probs: Optional[torch.Tensor] = None  # [T, K] float32
        self.token_indices: Optional[torch.Tensor] = None  # [T, K] int64, -1: none
        self.handle: Optional[ep.EpHandle] = None
        self.dispatched_probs: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self._ones: Optional[torch.Tensor] = None
        self._g: Optional[ep.Group] = None
        self._offs_host: Optional[torch.Tensor] = None  # pinned [L+1] int64
        self._offs_ready = None  # the CUDA event of its copy

    # -- metadata ----------------------------------------------------------------------

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        T, E, K = routing_map.shape[0], self.num_experts, self.router_topk
        routing_map = routing_map.reshape(T, E)
        probs = probs.reshape(T, E)
        # Routed experts in ascending id: key E - e for a routed e, 0 otherwise.
        key = routing_map.to(torch.int32) * torch.arange(E, 0, -1, dtype=torch.int32,
                                                         device=routing_map.device)
        top, idx = torch.topk(key, K, dim=1)
        routed = top > 0
        self.token_indices = torch.where(routed, idx, torch.full_like(idx, -1))
        self.token_probs = torch.where(routed, probs.gather(1, idx).float(),
                                       torch.zeros((), dtype=torch.float32, device=probs.device))

    # -- dispatch ----------------------------------------------------------------------

    def _group_for(self, x: torch.Tensor) -> ep.Group:
        s, T = self.settings, x.shape[0]
        if self._g is None:
            max_t = s.max_tokens_per_rank
            if max_t is None:  # the ranks' largest first dispatch (once per layer)
                t = torch.tensor([T], dtype=torch.int64, device=x.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                max_t = max(int(t.item()), 1)
            backend = s.backend or ("nccl" if x.is_cuda else "reference")
            self._g = make_group(self.group, num_experts=self.num_experts,
                                 topk=self.router_topk, hidden_size=self.hidden_size,
                                 dtype=x.dtype, max_tokens_per_rank=max_t, backend=backend,
                                 align=self.align, capacity_factor=s.capacity_factor,
                                 timeout=s.timeout, **s.options)
            self.over_budget = self.over_budget.to(x.device)
        g = self._g
        if T > g.max_tokens_per_rank:
            raise ValueError(f"this rank dispatches {T} tokens, more than the moeflow group's "
                             f"max_tokens_per_rank={g.max_tokens_per_rank} (sized on the first "
                             f"dispatch); pass the largest per-rank token count to "
                             f"moeflow.megatron.install(max_tokens_per_rank=...)")
        if x.dtype != g.dtype:
            raise ValueError(f"hidden_states are {x.dtype}, the moeflow group was made for "
                             f"{g.dtype} on the first dispatch")
        return g

    def _ones_rows(self, rows: int, device) -> torch.Tensor:
        if self._ones is None or self._ones.shape[0] < rows or self._ones.device != device:
            self._ones = torch.ones(rows, dtype=torch.float32, device=device)
        return self._ones[:rows]

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True,
                 allocate_on_comm_stream: bool = True) -> torch.Tensor:
        g = self._group_for(hidden_states)
        rows, _, _, h = ep.dispatch(hidden_states, self.token_indices, self.token_probs, g)
        self.handle = h
        if not self.static_shape and rows.is_cuda:
            # The experts need the offsets on the host: their copy starts now, so
            # that what megatron launches before the experts (the shared
            # experts' FC1) is queued before the host waits for it.
            if self._offs_host is None:
                self._offs_host = torch.empty(self.num_local_experts + 1, dtype=torch.int64,
                                              pin_memory=True)
            self._offs_host.copy_(h.expert_row_offsets, non_blocking=True)
            self._offs_ready = torch.cuda.Event()
            self._offs_ready.record()
        # The experts' probabilities: ones (combine applies the real ones).
        self.dispatched_probs = self._ones_rows(g.capacity_rows, rows.device)
        if self.settings.capacity_factor is not None:
            if self.over_budget.device != rows.device:
                self.over_budget = self.over_budget.to(rows.device)
            self.over_budget |= h.overflow.to(rows.device) > 0
        return rows

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        h = self.handle
        if self.static_shape:
            offs = h.expert_row_offsets
            self.tokens_per_expert = offs[1:] - offs[:-1]  # device int64
            return hidden_states, self.dispatched_probs
        # Megatron's experts split by host counts: one copy of the L + 1 offsets.
        if self._offs_ready is not None:
            self._offs_ready.synchronize()
            self._offs_ready = None
            offs = self._offs_host.clone()
        else:
            offs = h.expert_row_offsets.to("cpu")
        n = int(offs[-1])
        self.tokens_per_expert = offs[1:] - offs[:-1]  # CPU int64, pad rows included
        return _Narrow.apply(hidden_states, n), self.dispatched_probs[:n]

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert

    # -- combine -----------------------------------------------------------------------

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        if self.static_shape:
            return hidden_states
        return _ToCapacity.apply(hidden_states, self.handle.group.capacity_rows)

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                allocate_on_comm_stream: bool = True) -> torch.Tensor:
        out = ep.combine(hidden_states, self.handle, self.token_probs)
        # The way back lives on in autograd; release this call's state.
        self.handle = None
        self.dispatched_probs = None
        self.tokens_per_expert = None
        return out
