"""Expert parallelism from PyTorch (needs torch and torch.distributed).

    import moeflow.ep as ep
    group = ep.Group(num_experts=E, topk=K, hidden_size=H, dtype=torch.bfloat16,
                     max_tokens_per_rank=4096)            # over the default process group
    rows, tpe, offsets, handle = ep.dispatch(x, topk_ids, probs, group)
    y = ops.grouped_mlp(rows, fc1, fc2, offsets=offsets, real_rows=tpe)  # the local experts
    out = ep.combine(y, handle, probs)                    # [T, H], weighted by probs

W ranks each hold L = E / W experts: rank q owns the global experts
[q*L, (q+1)*L). :func:`dispatch` sends every token to the ranks of its
experts and returns there the received rows, permuted by local expert and
padded to ``align`` rows: local experts in order, inside an expert the rows
ordered by (source rank, token, k), pad rows zero. :func:`combine` brings
each token's expert outputs home: out[t] = sum over ranks q ascending of
partial_q[t], partial_q[t] = the float32 sum over k ascending of w[t,k] *
y_q[row] (a fused multiply-add chain), cast to y's dtype. Slots that do not
fit ``capacity_rows`` on their rank are dropped (experts in order: the tail
of the one that fits partially and every later one) and counted in
``handle.overflow``. These are the semantics of moeflow/ep_reference.h.

Every rank must call each operation (dispatch, combine and, through
autograd, their backward functions) in the same order: they are
collectives. Arguments are checked on each rank before any communication; a
check failing on some ranks only leaves the others waiting until the process
group's (or, for the device backends, the group's) timeout.

Backends:

- ``"nccl"`` / ``"nvlink"``: moeflow's CUDA backends (moeflow/ep.h,
  docs/ep.md) through ``moeflow._C.EpGroup``; one GPU per rank, the current
  CUDA device at group creation. Everything runs on torch's current stream.
  nccl copies the per-peer row counts to the host once per dispatch (dispatch
  is not CUDA-graph capturable; the rest does not synchronise); nvlink never
  synchronises.
- ``"reference"``: plain torch over ``torch.distributed.all_to_all_single``
  (gloo on the CPU, or nccl on GPUs): the readable oracle and the CPU path.
  It synchronises with the host (split sizes) and keeps per-slot copies; the
  fused multiply-add of combine is computed in float64 (equal to a fused
  float32 multiply-add but for rare double-rounding ties).

Each dispatch returns an :class:`EpHandle` that holds its way back: many
dispatches (layers) can be in flight, and activation recomputation
(torch.utils.checkpoint) works, each recomputed dispatch making its own.

FP8 dispatch: a group of dtype float8_e4m3fn / float8_e5m2 with
``scale_cols`` / ``scale_dtype`` moves FP8 rows with their per-token scales
(``dispatch(q, ids, probs, group, scales=s)``, ``handle.row_scales``),
forward-only w.r.t. the FP8 tokens; combine takes float expert outputs and
its backward runs in ``backward_dtype``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._ep_reference import _ref_away, _ref_dispatch, _ref_home, _ref_slots, _ref_sum
from .ops import _stream

__all__ = ["Group", "EpHandle", "dispatch", "combine", "recv_capacity_rows"]

_BACKENDS = ("nccl", "nvlink", "reference")
_ALIGNS = (1, 16, 32, 64, 128, 256)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Token dtypes -> moeflow's names (the binding's dtype strings).
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.float8_e4m3fn: "float8_e4m3", torch.float8_e5m2: "float8_e5m2"}
_SCALE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                 torch.int32: "int32", torch.uint8: "uint8"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _desc(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return "None"
    return f"{_name(t.dtype)} {list(t.shape)} on {t.device}"


def recv_capacity_rows(num_experts: int, world_size: int, topk: int, max_tokens_per_rank: int,
                       align: int, capacity_rows: int = -1) -> int:
    """Receive rows of every rank: ``capacity_rows`` when >= 0, else the worst
    case max_tokens_per_rank * W * min(K, E/W) + (E/W) * (align - 1), rounded up
    to align (moeflow/ep_reference.h, which computes it)."""
    return int(_C.ep_recv_capacity_rows(int(num_experts), int(world_size), int(topk),
                                        int(max_tokens_per_rank), int(align),
                                        int(capacity_rows)))


class Group:
    """An expert-parallel group over a torch.distributed process group.

    ``process_group``: the ranks (None: the default group); rank and world
    size come from it. ``num_experts`` E (a multiple of the world size W),
    ``topk`` K, ``hidden_size`` H and ``dtype`` (bfloat16 / float16 / float32,
    or float8_e4m3fn / float8_e5m2: FP8 dispatch, below) of the dispatched
    tokens; ``max_tokens_per_rank`` bounds T on every rank
    (it sizes the buffers); ``align`` (1, 16, 32, 64, 128, 256) pads each
    local expert's rows; ``capacity_rows`` the receive rows per rank (-1: the
    worst case, see :func:`recv_capacity_rows`; else a multiple of align).
    ``timeout`` (seconds) bounds a device backend's waits for its peers.
    ``scale_cols`` S > 0: every dispatch takes per-token scales [T, S] of
    ``scale_dtype`` (float32 / bfloat16 / float16 / int32 / uint8) that
    travel with the token's rows (:func:`dispatch`'s ``scales``,
    ``handle.row_scales``); 0: none.
    ``combine_wire_dtype`` (float32 / bfloat16): what a rank sends home in
    :func:`combine` (and the dispatch's backward) for a token with several
    slots there: their float32 sum, or that sum rounded to bfloat16 (half
    the bytes; needs ``hidden_size`` % 8 == 0). A token's only slot crosses
    as its row of y either way; the sums at home stay float32. Every rank
    passes the same value (docs/ep.md).
    ``backward_dtype`` (FP8 tokens only; float32 / float16 / bfloat16,
    default bfloat16): the dtype of the gradients that go back through
    combine's backward (``dout``; on the nvlink backend also combine's y).
    A float token dtype uses its own (passing another one is an error).
    ``options``: further ``EpOptions`` fields of the device backends (e.g.
    ``pipeline_chunks``, ``nvlink_blocks``; docs/tuning.md), passed to
    ``moeflow._C.EpGroup`` by name; none for the reference backend.
    ``nvlink_recv_regions`` (nvlink, default 2): with n + 1, n dispatches in
    flight (layers between their forward and backward) keep their received
    rows where they landed in the group's window instead of copying them;
    such rows live as long as the group, so keep the group while using them.
    ``nvlink_quantize_in_dispatch`` (nvlink, FP8 groups; default -1, auto):
    where :func:`dispatch` of 16-bit tokens quantizes them, in the dispatch
    kernel (1) or into staging rows first (0); auto takes the kernel for
    top-k >= 4 (docs/ep.md).

    The device backends need the current CUDA device set to the rank's GPU
    (torch.cuda.set_device) before the group is made; every rank makes its
    group together (rank 0 makes an NCCL id and broadcasts it through the
    process group). The reference backend works on the tensors' device,
    which the process group's backend must support (gloo: CPU, nccl: CUDA).

    FP8 dispatch (``dtype`` float8_e4m3fn / float8_e5m2): the rows travel as
    their H bytes, usually with their block scales (e.g. ``ops.quantize``'s
    1x128 scales: ``scale_cols`` = ceil(H / 128), float32); the experts'
    outputs y that :func:`combine` takes are float (``backward_dtype`` on the
    nvlink backend). Such a dispatch is forward-only w.r.t. x (see
    :func:`dispatch`). The nvlink backend needs H a multiple of 16.
    """

    def __init__(self, process_group=None, *, num_experts: int, topk: int, hidden_size: int,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "nccl",
                 max_tokens_per_rank: int, align: int = 16, capacity_rows: int = -1,
                 timeout: float = 300.0, scale_cols: int = 0,
                 scale_dtype: torch.dtype = torch.float32,
                 backward_dtype: Optional[torch.dtype] = None,
                 combine_wire_dtype: torch.dtype = torch.float32, **options):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moeflow.ep.Group needs torch.distributed initialised "
                               "(torch.distributed.init_process_group), it is not")
        W = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("moeflow.ep.Group: this process is not a member of process_group")
        E, K, H = int(num_experts), int(topk), int(hidden_size)
        if E <= 0 or E % W:
            raise ValueError(f"num_experts must be a positive multiple of the world size {W}, "
                             f"got {E}")
        if not 1 <= K <= min(E, 32):
            raise ValueError(f"topk must be in [1, min(num_experts={E}, 32)], got {K}")
        if H <= 0:
            raise ValueError(f"hidden_size must be > 0, got {H}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16, torch.float16, torch.float32, "
                             f"torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
        if backward_dtype is None:
            grad_dtype = torch.bfloat16 if dtype in _FP8 else dtype
        elif backward_dtype not in _FLOATS:
            raise ValueError(f"backward_dtype must be torch.bfloat16, torch.float16 or "
                             f"torch.float32, got {backward_dtype}")
        elif dtype in _FLOATS and backward_dtype != dtype:
            raise ValueError(f"backward_dtype is for FP8 tokens: a {_name(dtype)} group's "
                             f"gradients are {_name(dtype)}, got backward_dtype={backward_dtype}")
        else:
            grad_dtype = backward_dtype
        if isinstance(scale_cols, bool) or not isinstance(scale_cols, int) or scale_cols < 0:
            raise ValueError(f"scale_cols must be an int >= 0 (0: no scales), got {scale_cols!r}")
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of "
                             f"{', '.join(str(d) for d in _SCALE_DTYPES)}, got {scale_dtype}")
        if combine_wire_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"combine_wire_dtype must be torch.float32 or torch.bfloat16, "
                             f"got {combine_wire_dtype}")
        if combine_wire_dtype == torch.bfloat16 and H % 8:
            raise ValueError(f"combine_wire_dtype=torch.bfloat16 needs hidden_size % 8 == 0, "
                             f"got {H}")
        if int(align) not in _ALIGNS:
            raise ValueError(f"align must be one of {_ALIGNS}, got {align}")
        align = int(align)
        if int(max_tokens_per_rank) < 0:
            raise ValueError(f"max_tokens_per_rank must be >= 0, got {max_tokens_per_rank}")
        capacity_rows = int(capacity_rows)
        if capacity_rows != -1 and (capacity_rows < 0 or capacity_rows % align):
            raise ValueError(f"capacity_rows must be -1 (the worst case) or a non-negative "
                             f"multiple of align={align}, got {capacity_rows}")
        if not float(timeout) >= 0:
            raise ValueError(f"timeout must be >= 0 seconds (0: wait forever), got {timeout}")
        if backend == "reference" and options:
            raise ValueError(f"the reference backend takes no options, got "
                             f"{sorted(options)}")
        self.process_group = process_group
        self.rank, self.world_size = rank, W
        self.num_experts, self.topk, self.hidden_size, self.dtype = E, K, H, dtype
        # The dtype of the gradient rows (combine's dout; nvlink: its y too).
        self.backward_dtype = grad_dtype
        self.scale_cols, self.scale_dtype = int(scale_cols), scale_dtype
        self.combine_wire_dtype = combine_wire_dtype
        self.local_experts = E // W
        self.expert_range = (rank * self.local_experts, (rank + 1) * self.local_experts)
        self.backend, self.align = backend, align
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.timeout = float(timeout)
        self.device: Optional[torch.device] = None
        self._g = None
        if backend == "reference":
            self.capacity_rows = recv_capacity_rows(E, W, K, self.max_tokens_per_rank, align,
                                                    capacity_rows)
            return
        if not hasattr(_C, "EpGroup"):
            raise RuntimeError(f"backend {backend!r} needs moeflow's expert-parallel extension "
                               f"(moeflow._C.EpGroup), which this build does not have (built "
                               f"without CUDA?); use backend='reference'")
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {backend!r} needs a CUDA device, torch sees none")
        dev = torch.cuda.current_device()
        self.device = torch.device("cuda", dev)
        obj = [_C.ep_unique_id() if rank == 0 else None]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(obj, src=src, group=process_group)
        uid = bytes(obj[0])
        if len(uid) != 128:
            raise RuntimeError(f"the broadcast NCCL id has {len(uid)} bytes, expected 128")
        self._g = _C.EpGroup(uid, rank, W, dev, backend, E, K, H, _DTYPES[dtype], align,
                             self.max_tokens_per_rank, capacity_rows, self.timeout,
                             backward_dtype=_DTYPES[grad_dtype], scale_cols=self.scale_cols,
                             scale_dtype=_SCALE_DTYPES[scale_dtype],
                             combine_wire_dtype=_DTYPES[combine_wire_dtype], **options)
        self.capacity_rows = int(self._g.capacity_rows)

    def destroy(self) -> None:
        """Releases a device backend's group (its buffers and communicator);
        every rank calls it together, once no handle of it is in use."""
        self._g = None

    def __repr__(self) -> str:
        return (f"moeflow.ep.Group(backend={self.backend!r}, rank={self.rank}, "
                f"world_size={self.world_size}, num_experts={self.num_experts}, "
                f"local_experts={self.local_experts}, topk={self.topk}, "
                f"hidden_size={self.hidden_size}, dtype={self.dtype}, align={self.align}, "
                f"capacity_rows={self.capacity_rows}"
                + (f", scale_cols={self.scale_cols}, scale_dtype={self.scale_dtype}"
                   if self.scale_cols else "")
                + (f", backward_dtype={self.backward_dtype}" if self.dtype in _FP8 else "")
                + ")")


class EpHandle:
    """One dispatch's state: what its combine and the backward functions need
    (the way back). Made by :func:`dispatch`; on the device backends it holds
    the C++ handle, whose buffers (the received rows among them) stay alive
    while it or a tensor viewing them lives.

    Tensors (on the group's device): ``row_probs`` [capacity] float32 (the
    rows' probabilities, 0 on pad rows; meaningful when dispatched with
    probs), ``row_scales`` [capacity, S] of the group's ``scale_dtype`` (the
    rows' scales when the group has ``scale_cols`` S > 0: row i's are those
    of the token on row i; pad rows zero, rows past ``total_rows``
    unspecified; None without scales), ``tokens_per_expert`` [L] int32,
    ``expert_row_offsets`` [L+1] int64, ``total_rows`` [1] int64 (rows used),
    ``overflow`` [1] int32 (slots sent to this rank that did not fit).
    ``num_tokens``: T of this rank."""

    __slots__ = ("group", "num_tokens", "device", "x_dtype", "weighted", "_probs_key", "_h",
                 "_ref", "row_probs", "row_scales", "tokens_per_expert", "expert_row_offsets",
                 "total_rows", "overflow", "_quantize")

    def __init__(self, group: Group):
        self.group = group
        self._h = self._ref = self.row_scales = self._quantize = None

    def __repr__(self) -> str:
        return (f"moeflow.ep.EpHandle(backend={self.group.backend!r}, "
                f"num_tokens={self.num_tokens}, capacity_rows={self.group.capacity_rows})")


# ---------------------------------------------------------------------------
# Autograd functions.

def _dispatch_forward(x, ids, probs, scales, h: EpHandle) -> torch.Tensor:
    g = h.group
    quantize = h._quantize is not None  # 16-bit x into an FP8 group: its 1x128 codes cross
    if g.backend == "reference":
        if quantize:
            from . import _fp8_ops
            x, scales = _fp8_ops.quantize(x, "e5m2" if g.dtype == torch.float8_e5m2 else "e4m3",
                                          "1x128", h._quantize)
        return _ref_dispatch(g, x, ids, probs, scales, h)
    if quantize:
        c = g._g.dispatch_quantize(x, ids, probs, h._quantize, stream=_stream(x))
    else:
        c = g._g.dispatch(x, ids, probs, scales, stream=_stream(x))
    h._h = c
    h.row_probs = torch.from_dlpack(c.probs)
    h.row_scales = None if scales is None and not quantize else torch.from_dlpack(c.scales)
    h.tokens_per_expert = torch.from_dlpack(c.tokens_per_expert)
    h.expert_row_offsets = torch.from_dlpack(c.expert_row_offsets)
    h.total_rows = torch.from_dlpack(c.total_rows)
    h.overflow = torch.from_dlpack(c.overflow)
    return torch.from_dlpack(c.x)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, args):  # ctx None: called without autograd
        ids, probs, scales, h = args
        rows = _dispatch_forward(x, ids, probs, scales, h)
        if ctx is not None:
            ctx.handle = h
            ctx.mark_non_differentiable(h.tokens_per_expert, h.expert_row_offsets)
        return rows, h.tokens_per_expert, h.expert_row_offsets

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows, _tpe=None, _offsets=None):
        return _dispatch_backward(ctx.handle, grad_rows), None


def _dispatch_backward(h: EpHandle, grad_rows: torch.Tensor) -> torch.Tensor:
    """The tokens' gradient [T, H] of a dispatch from its rows' gradient."""
    g = h.group
    grad_rows = grad_rows.to(g.backward_dtype if g.dtype in _FP8 else g.dtype)
    if g.backend == "reference":  # a combine without weights
        return _ref_sum(h, _ref_slots(h, _ref_home(h, grad_rows)), None, h.x_dtype)
    grad_x = torch.empty((h.num_tokens, g.hidden_size), dtype=h.x_dtype, device=h.device)
    g._g.dispatch_backward(h._h, grad_rows.contiguous(), grad_x, _stream(grad_rows))
    return grad_x


def _combine_forward(y: torch.Tensor, probs: Optional[torch.Tensor], h: EpHandle):
    """(out [T, H], what the combine's backward reads of y or None)."""
    g = h.group
    if g.backend == "reference":
        y_home = _ref_slots(h, _ref_home(h, y))  # [T, K, H] float64
        return _ref_sum(h, y_home, probs, y.dtype), (y_home if probs is not None else None)
    y = y.contiguous()
    out = torch.empty((h.num_tokens, g.hidden_size), dtype=y.dtype, device=y.device)
    g._g.combine(h._h, y, probs is not None, out, _stream(y))
    # y for the probs' gradient (the nvlink backend reads it always)
    return out, (y if probs is not None or g.backend == "nvlink" else None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, probs, h):  # ctx None: called without autograd
        out, kept = _combine_forward(y, probs, h)
        if ctx is not None:
            ctx.set_materialize_grads(False)
            ctx.handle, ctx.y_dtype = h, y.dtype
            ctx.save_for_backward(probs, kept)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        probs, y = ctx.saved_tensors
        grad_y, dprobs = _combine_backward(ctx.handle, probs, y, ctx.y_dtype, dout)
        return grad_y, dprobs, None


def _combine_backward(h: EpHandle, probs: Optional[torch.Tensor], y: Optional[torch.Tensor],
                      dtype: torch.dtype, dout: Optional[torch.Tensor]):
    """(grad_y [capacity, H], dprobs [T, K] or None) of a combine from its
    output's gradient (None: zero; every rank takes part); y: what
    _combine_forward kept."""
    g = h.group
    dev, T, K = h.device, h.num_tokens, g.topk
    if dout is None:  # every rank takes part: a zero gradient
        dout = torch.zeros((T, g.hidden_size), dtype=dtype, device=dev)
    if g.backend == "reference":
        st = h._ref
        d = dout.float()[st.send_slots // K]
        if probs is not None:
            d = probs.detach().reshape(-1)[st.send_slots].unsqueeze(1) * d
        grad_y = _ref_away(h, d.to(dtype))
        dprobs = None
        if probs is not None:
            dot = (dout.double().unsqueeze(1) * y).sum(-1)
            dprobs = torch.where(st.dest_row >= 0, dot, torch.zeros_like(dot)).float()
        return grad_y, dprobs
    weighted = probs is not None
    shape = (g.capacity_rows, g.hidden_size)
    if y is None:  # not read (unweighted): any rows of the shape
        y = torch.empty(shape, dtype=dtype, device=dev)
    grad_y = torch.empty(shape, dtype=dtype, device=dev)
    dprobs = torch.empty((T, K), dtype=torch.float32, device=dev) if weighted else None
    g._g.combine_backward(h._h, dout.to(g.backward_dtype).contiguous(), y, weighted, grad_y,
                          dprobs, _stream(dout))
    return grad_y, dprobs


def _check_same_device(name: str, t: torch.Tensor, dev: torch.device) -> None:
    if t.device != dev:
        raise ValueError(f"{name} must be on {dev} (x's device), got {t.device}")


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, probs: Optional[torch.Tensor],
             group: Group, scales: Optional[torch.Tensor] = None, *,
             pow2_scales: bool = False
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, EpHandle]:
    """Sends this rank's tokens to the ranks of their experts.

    x [T, H] of the group's dtype (T <= max_tokens_per_rank, may be 0 and may
    differ per rank); topk_ids [T, K] int32 / int64 global expert ids (-1:
    none); probs [T, K] float32 or None (the rows carry them; pass the same
    tensor to :func:`combine` to weight the outputs by it); scales [T, S] of
    the group's ``scale_dtype`` when the group has ``scale_cols`` S > 0 (then
    on every dispatch), else None: each token's scales travel with its rows
    (``handle.row_scales``).

    Returns (rows [capacity, H] in x's dtype: the received rows of the local
    experts, permuted and padded, pad rows zero, rows past ``total_rows``
    unspecified; tokens_per_expert [L] int32: the rows kept per local expert;
    expert_row_offsets [L+1] int64: their segments; handle). With float
    tokens, rows is differentiable w.r.t. x (backward: the rows' gradients
    summed home, a combine without weights). FP8 tokens (an FP8 group): x is
    the FP8 rows, e.g. ``q, s = ops.quantize(x, "e4m3")`` (1x128 blocks: s is
    [T, ceil(H/128)] float32, one row of scales per token, which is this
    layout), then ``dispatch(q, ids, probs, group, scales=s)``; rows are the
    FP8 bytes as sent, bit for bit, and the dispatch is forward-only w.r.t.
    x (x must not require grad; rows and row_scales carry no gradient). The
    gradient of the tokens before quantization is the rows' gradient summed
    home, ``combine(grad_rows, handle)`` (no probs; grad_rows of a float
    dtype, ``backward_dtype`` on the nvlink backend), which a caller's
    autograd function can return from its backward (docs/python.md).

    16-bit tokens into an FP8 group made with ``scale_cols`` = ceil(H/128)
    and float32 ``scale_dtype``: x (bfloat16 / float16, scales None) is
    quantized on its way, 1x128 blocks of the group's FP8 dtype
    (``pow2_scales``: scales rounded up to powers of two), and the codes
    cross with their scales; the result is bitwise ``dispatch(q, ids, probs,
    group, scales=s)`` of ``q, s = ops.quantize(x, fmt, "1x128",
    pow2_scales)``, without writing q and s (the nvlink backend quantizes in
    its dispatch kernel; the nccl backend into the group's staging rows).
    Forward-only w.r.t. x, as FP8 tokens are.

    An id outside [-1, E) travels as unrouted; the reference and nccl
    backends then raise on that rank once the dispatch completed (no rank
    waits), the nvlink backend counts it on the device (moeflow/ep.h).
    """
    xin, args = _prepare_dispatch(x, topk_ids, probs, group, scales, pow2_scales)
    if torch.is_grad_enabled() and x.requires_grad:
        rows, tpe, offs = _Dispatch.apply(xin, args)
    else:
        rows, tpe, offs = _Dispatch.forward(None, xin.detach(), args)
    return rows, tpe, offs, args[3]


def _prepare_dispatch(x, topk_ids, probs, group, scales, pow2_scales=False):
    """dispatch's argument checks; (x as the dispatch reads it, (ids, probs,
    scales, handle)) with a new handle."""
    if not isinstance(group, Group):
        raise TypeError(f"group must be a moeflow.ep.Group, got {type(group).__name__}")
    g = group
    H, K = g.hidden_size, g.topk
    fp8 = g.dtype in _FP8
    # 16-bit tokens into an FP8 group: quantized by the dispatch
    quantize = (fp8 and isinstance(x, torch.Tensor)
                and x.dtype in (torch.bfloat16, torch.float16))
    want_x = (f"{_name(g.dtype)}, or bfloat16 / float16 to quantize," if fp8
              else _name(g.dtype))
    if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != H
            or (x.dtype != g.dtype and not quantize)):
        raise ValueError(f"x must be {want_x} [T, {H}], got "
                         f"{_desc(x) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if pow2_scales and not quantize:
        raise ValueError("pow2_scales is for 16-bit tokens into an FP8 group (the dispatch "
                         f"quantizes them); x is {_desc(x)} into a {_name(g.dtype)} group")
    if quantize:
        nb = -(-H // 128)
        if g.scale_cols != nb or g.scale_dtype != torch.float32 or scales is not None:
            raise ValueError(
                f"16-bit tokens into an FP8 group are quantized 1x128 by the dispatch: the group "
                f"needs scale_cols={nb} (ceil(H/128)) of float32 and scales must be None; got "
                f"scale_cols={g.scale_cols} of {g.scale_dtype}, scales "
                f"{'given' if scales is not None else 'None'}")
    T = x.shape[0]
    if T > g.max_tokens_per_rank:
        raise ValueError(f"x has {T} tokens, more than the group's max_tokens_per_rank="
                         f"{g.max_tokens_per_rank}")
    if g.device is not None and x.device != g.device:
        raise ValueError(f"x must be on the group's device {g.device}, got {x.device}")
    if fp8 and x.requires_grad:
        raise ValueError(f"the dispatch of FP8 tokens ({_name(g.dtype)}) is forward-only: x must "
                         f"not require grad (the gradient of the tokens before quantization "
                         f"is combine(grad_rows, handle))")
    if (not isinstance(topk_ids, torch.Tensor) or tuple(topk_ids.shape) != (T, K)
            or topk_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"topk_ids must be int32 or int64 [{T}, {K}], got "
                         f"{_desc(topk_ids) if isinstance(topk_ids, torch.Tensor) else topk_ids}")
    _check_same_device("topk_ids", topk_ids, x.device)
    if probs is not None:
        if tuple(probs.shape) != (T, K) or probs.dtype != torch.float32:
            raise ValueError(f"probs must be float32 [{T}, {K}] or None, got {_desc(probs)}")
        _check_same_device("probs", probs, x.device)
    S = g.scale_cols
    if S and not quantize:
        want = f"{_name(g.scale_dtype)} [{T}, {S}]"
        if scales is None:
            raise ValueError(f"scales must be {want} (the group was made with scale_cols={S}: "
                             f"every dispatch takes scales), got None")
        if (not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (T, S)
                or scales.dtype != g.scale_dtype):
            got = _desc(scales) if isinstance(scales, torch.Tensor) else repr(scales)
            raise ValueError(f"scales must be {want}, got {got}")
        _check_same_device("scales", scales, x.device)
    elif scales is not None:
        got = _desc(scales) if isinstance(scales, torch.Tensor) else repr(scales)
        raise ValueError(f"scales given ({got}), but the group was made without scales "
                         f"(scale_cols=0; make it with scale_cols and scale_dtype)")
    if g.backend != "reference" and g._g is None:
        raise RuntimeError("the group was destroyed")
    h = EpHandle(g)
    h.num_tokens, h.device, h.x_dtype, h.weighted = T, x.device, x.dtype, probs is not None
    h._quantize = bool(pow2_scales) if quantize else None
    h._probs_key = None if probs is None else (probs.data_ptr(), tuple(probs.stride()))
    ids = topk_ids.detach().contiguous()
    p = None if probs is None else probs.detach().contiguous()
    sc = None if scales is None else scales.detach().contiguous()
    xin = x if g.backend == "reference" else x.contiguous()
    return xin, (ids, p, sc, h)


def combine(y: torch.Tensor, handle: EpHandle, probs: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """Brings the expert outputs home: y [capacity, H] (float32 / float16 /
    bfloat16; the nvlink backend: the group's dtype, ``backward_dtype`` with
    FP8 tokens) -> out [T, H] in y's dtype, out[t] = sum over ranks q
    ascending of the float32 fma chain over t's kept slots on q, k ascending,
    of w * y[row]; tokens with no kept slot give zeros. Rows of y other than
    the dispatched slots' are not read.

    ``probs``: None (w = 1) or the [T, K] float32 tensor given to the
    handle's :func:`dispatch` (w = probs[t, k]; the values at dispatch are
    used). Differentiable w.r.t. y and probs: backward sends w * dout[t] to
    each slot's row (pad rows zero) and gives dprobs[t, k] = <dout[t],
    y[row]> (0 for unrouted or dropped slots)."""
    if not isinstance(handle, EpHandle):
        raise TypeError(f"handle must be the moeflow.ep.EpHandle of a dispatch, got "
                        f"{type(handle).__name__}")
    g = handle.group
    shape = (g.capacity_rows, g.hidden_size)
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != shape or y.dtype not in _FLOATS:
        raise ValueError(f"y must be float32, float16 or bfloat16 {list(shape)}, got "
                         f"{_desc(y) if isinstance(y, torch.Tensor) else type(y).__name__}")
    if g.backend == "nvlink" and y.dtype != g.backward_dtype:
        raise ValueError(f"the nvlink backend needs y of the group's gradient dtype "
                         f"{_name(g.backward_dtype)} (its dtype, or backward_dtype with FP8 "
                         f"tokens), got {_name(y.dtype)}")
    if y.device != handle.device:
        raise ValueError(f"y must be on {handle.device} (the dispatch's device), got "
                         f"{y.device}")
    if probs is not None:
        T, K = handle.num_tokens, g.topk
        if tuple(probs.shape) != (T, K) or probs.dtype != torch.float32:
            raise ValueError(f"probs must be float32 [{T}, {K}] or None, got {_desc(probs)}")
        if not handle.weighted:
            raise ValueError("combine got probs, but the handle's dispatch had none "
                             "(pass probs to dispatch, or None to combine)")
        if (probs.data_ptr(), tuple(probs.stride())) != handle._probs_key:
            raise ValueError("probs must be the tensor given to the handle's dispatch "
                             "(its rows carry the weights)")
    if torch.is_grad_enabled() and (y.requires_grad or (probs is not None
                                                        and probs.requires_grad)):
        return _Combine.apply(y, probs, handle)
    return _Combine.forward(None, y, probs, handle)
