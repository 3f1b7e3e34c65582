"""TransformerEngine's mask-form permutation API on moeflow's ops (needs torch).

    from moeflow.permutation import (moe_permute, moe_permute_with_probs,
                                     moe_permute_and_pad_with_probs, moe_unpermute)

The same names, argument names, defaults and return values as
``transformer_engine.pytorch.permutation`` (TE 2.x) with a [T, E] routing
mask (``map_type="mask"``), so that code written for TE (Megatron-Core's
``moe_utils.permute`` / ``unpermute`` with ``moe_permute_fusion``) can import
these instead. They run on the CPU and on CUDA, are differentiable in the
same inputs as TE's, and run on torch's current stream.

Layout (as TE's mask map): rows grouped by expert in id order, and within an
expert by ascending token id; the pad variant pads each expert's segment at
its end to a multiple of ``align_size`` with zero rows.

What differs from TE:

- ``row_id_map`` is a :class:`RowIdMap` (it holds the moeflow
  :class:`~moeflow.ops.Plan` built on the device), not TE's int32
  [T, 2E+1] tensor. Pass it back to :func:`moe_unpermute` as TE users do;
  code that uses it as a tensor (indexing it, returning it from a CUDA graph
  as a tensor, moving it between devices) does not work.
- ``num_out_tokens`` smaller than the routed count drops slots (the last
  ones in the permuted order: the tail of the expert that fits partially
  and every later expert, as Megatron's argsort permute with
  ``num_out_tokens``), counted in ``row_id_map.plan.overflow`` on the
  device; TE writes past its buffer there. Dropped slots get no row: they
  add nothing in :func:`moe_unpermute` and get zero gradients.
- The pad variant returns ``pad_offsets`` as a tensor always (TE: None when
  no expert needs padding, which it finds with a host sync), and
  :func:`moe_unpermute` reads the padding from ``row_id_map``, so its
  ``pad_offsets`` argument is accepted and not needed.
- probs travel as float32 (moeflow's permute) and come back in probs'
  dtype: exact for float32 / bfloat16 / float16, rounded to float32 for
  float64. The permuted probs' gradient is float32 rounded to probs' dtype.
- Rows of the permuted buffer past the routed ones (``num_out_tokens``
  larger than the routed count) are left as allocated, as in TE.
- Only the mask form: ``map_type="index"`` (top-k ids) is moeflow's own
  ``moeflow.ops.Plan(topk_ids, E)`` with ``ops.permute`` / ``ops.unpermute``.

Host synchronisation: none, except reading ``num_out_tokens`` when it is a
CUDA tensor, and the pad variant's output size (the sum of the padded
counts, read from ``tokens_per_expert`` as TE does: a sync when that is a
CUDA tensor; give ``num_out_tokens=`` to avoid it). With Python ints these
calls can be captured in a CUDA graph.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple, Union

import torch

from . import ops as _ops

__all__ = ["RowIdMap", "moe_permute", "moe_permute_with_probs",
           "moe_permute_and_pad_with_probs", "moe_unpermute"]

_IntLike = Union[int, torch.Tensor]


class RowIdMap:
    """The ``row_id_map`` of the permute functions here: give it to
    :func:`moe_unpermute`. ``plan`` is the moeflow :class:`~moeflow.ops.Plan`
    of the [T, E] mask (slot (t, e) is token t's copy for expert e), on the
    mask's device; ``plan.dest_row`` [T, E] int64 is the row of each slot
    (-1: not routed or dropped), ``plan.overflow`` [1] int32 the dropped
    slots. Reading them on the host synchronises."""

    __slots__ = ("plan",)

    def __init__(self, plan: _ops.Plan):
        self.plan = plan

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def num_experts(self) -> int:
        return self.plan.num_experts

    @property
    def num_out_tokens(self) -> int:
        """Rows of the permuted buffer."""
        return self.plan.capacity_rows

    @property
    def align_size(self) -> int:
        return self.plan.align

    def __repr__(self) -> str:
        p = self.plan
        return (f"RowIdMap(num_tokens={p.num_tokens}, num_experts={p.num_experts}, "
                f"num_out_tokens={p.capacity_rows}, align_size={p.align})")


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype)[6:]} {list(t.shape)} on {t.device}"


def _check_inp(inp) -> None:
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2:
        raise ValueError(f"inp must be a [num_tokens, hidden_size] tensor, got {_desc(inp)}")


def _mask(routing_map, inp: torch.Tensor) -> torch.Tensor:
    """routing_map [T, E] (bool, or any integer / float dtype: nonzero =
    routed) as the bool / uint8 mask the plan takes."""
    if (not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2
            or routing_map.shape[0] != inp.shape[0] or routing_map.is_complex()):
        raise ValueError(f"routing_map must be a [num_tokens={inp.shape[0]}, num_experts] mask "
                         f"(bool or int) on {inp.device}, got {_desc(routing_map)}")
    if routing_map.device != inp.device:
        raise ValueError(f"routing_map must be on inp's device {inp.device}, got "
                         f"{_desc(routing_map)}")
    if routing_map.dtype not in (torch.bool, torch.uint8):
        routing_map = routing_map != 0
    return routing_map.detach()


def _check_probs(name: str, probs, T: int, E: int, device) -> None:
    if (not isinstance(probs, torch.Tensor) or not probs.is_floating_point()
            or tuple(probs.shape) != (T, E)):
        raise ValueError(f"{name} must be a float tensor [num_tokens, num_experts]=[{T}, {E}] "
                         f"on {device}, got {_desc(probs)}")
    if probs.device != device:
        raise ValueError(f"{name} must be on {device}, got {_desc(probs)}")


def _count(name: str, n: _IntLike) -> int:
    """An int, or the value of a 0-dim / 1-element integer tensor (a host
    sync when it lives on a GPU)."""
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.is_floating_point() or n.is_complex():
            raise ValueError(f"{name} must be an int or a 1-element integer tensor, "
                             f"got {_desc(n)}")
        return int(n.item())
    if isinstance(n, bool) or not isinstance(n, int):
        try:
            import numpy as np  # numpy ints (Megatron's counts may be numpy)
            if isinstance(n, np.integer):
                return int(n)
        except ImportError:
            pass
        raise ValueError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    return n


def _out_rows(num_out_tokens: _IntLike, T: int) -> int:
    n = _count("num_out_tokens", num_out_tokens)
    if T == 0:  # as TE: an empty input gives an empty output whatever the count
        return 0
    if n <= 0:
        raise ValueError(f"num_out_tokens must be > 0 (the rows of the permuted buffer, e.g. "
                         f"int(routing_map.sum()) or num_tokens * topk), got {n}")
    return n


def _permute(inp, probs, mask, align: int, rows: int, zero: bool):
    """Plan + moeflow permute; (output, permuted probs or None, RowIdMap)."""
    plan = _ops.Plan.from_mask(mask, align=align, capacity_rows=rows)
    if rows == 0:  # nothing to move (the ops' backward wants non-empty gradients)
        y = inp.narrow(0, 0, 0).clone()
        pp = None if probs is None else probs.reshape(-1).narrow(0, 0, 0).clone()
        return y, pp, RowIdMap(plan)
    p32 = None
    if probs is not None:
        p32 = probs if probs.dtype == torch.float32 else probs.float()
    y, pp = _ops.permute(inp, plan, p32)
    if pp is None:
        return y, None, RowIdMap(plan)
    if zero and y.numel():
        # TE writes a zero row for a routed slot whose prob is 0 (a padding
        # slot of a padded routing map); its gradient still reaches inp.
        # Zero bytes are +0 in every float format (also FP8).
        with torch.no_grad():
            y.view(torch.uint8).masked_fill_((pp == 0).unsqueeze(1), 0)  # [rows, H * bytes]
    if probs.dtype != torch.float32:
        pp = pp.to(probs.dtype)
    return y, pp, RowIdMap(plan)


def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: _IntLike = -1,
                max_token_num: int = -1, map_type: str = "mask"
                ) -> Tuple[torch.Tensor, RowIdMap]:
    """TE's ``moe_permute`` (mask form): inp [T, H] (float32 / float16 /
    bfloat16, or FP8 without gradient), routing_map [T, E] (bool or int;
    nonzero = routed) -> (output [num_out_tokens, H] in inp's dtype, grouped
    by expert; row_id_map, a :class:`RowIdMap`).

    ``num_out_tokens``: rows of the output (> 0; an int, or a 1-element
    tensor: a host sync if on a GPU); fewer than the routed slots drops the
    last ones (see the module notes). ``max_token_num`` is ignored (a
    workspace hint of TE's index form). Differentiable in inp; no host sync.
    """
    if map_type != "mask":
        raise ValueError(f"map_type must be 'mask' (the [T, E] routing mask), got {map_type!r}; "
                         f"for top-k ids use moeflow.ops.Plan(topk_ids, num_experts)")
    _check_inp(inp)
    mask = _mask(routing_map, inp)
    y, _, row_id_map = _permute(inp, None, mask, 1, _out_rows(num_out_tokens, inp.shape[0]),
                                False)
    return y, row_id_map


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: _IntLike = -1, *,
                           zero_rows_of_zero_probs: bool = True
                           ) -> Tuple[torch.Tensor, torch.Tensor, RowIdMap]:
    """TE's ``moe_permute_with_probs``: tokens and their probs permuted by a
    [T, E] routing mask.

    inp [T, H] float32 / float16 / bfloat16; probs [T, E] float (the prob of
    token t for expert e; read where routed); routing_map [T, E] bool or int
    (nonzero = routed); ``num_out_tokens`` the output rows (> 0, e.g.
    ``int(routing_map.sum())`` or T * topk; an int, or a 1-element tensor:
    a host sync if on a GPU; fewer than the routed slots drops the last ones).

    Returns (output [num_out_tokens, H] in inp's dtype; permuted_probs
    [num_out_tokens] in probs' dtype; row_id_map, a :class:`RowIdMap` for
    :func:`moe_unpermute`). Gradients reach inp (each token's rows summed in
    float32) and probs (zero where not routed or dropped).

    ``zero_rows_of_zero_probs`` (default, as TE): a routed slot whose prob is
    exactly 0 gets a zero row (the padding slots of a padded routing map);
    the gradient of that row still reaches inp, as in TE. False skips that
    pass over the output (one read and write of it) and keeps the token's
    values in such rows. No host sync.
    """
    _check_inp(inp)
    mask = _mask(routing_map, inp)
    _check_probs("probs", probs, inp.shape[0], mask.shape[1], inp.device)
    return _permute(inp, probs, mask, 1, _out_rows(num_out_tokens, inp.shape[0]),
                    zero_rows_of_zero_probs)


_ALIGNS = (1, 16, 32, 64, 128, 256)


def moe_permute_and_pad_with_probs(
        inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
        tokens_per_expert: Optional[torch.Tensor], align_size: int, *,
        num_out_tokens: Optional[int] = None, zero_rows_of_zero_probs: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, RowIdMap, torch.Tensor, torch.Tensor]:
    """TE's ``moe_permute_and_pad_with_probs``: :func:`moe_permute_with_probs`
    with each expert's segment padded at its end with zero rows (and zero
    probs) to a multiple of ``align_size`` (1, 16, 32, 64, 128 or 256).

    ``tokens_per_expert`` [E] (int or float, any device): the routed tokens
    of each expert (the column sums of routing_map), read only to size the
    output: rows = sum(ceil(tokens_per_expert / align_size) * align_size), a
    host sync when it lives on a GPU (as in TE). The layout itself comes
    from routing_map; counts smaller than the mask's drop the last slots.
    ``num_out_tokens`` (keyword, moeflow's; a multiple of align_size, at
    least that sum): the output rows without reading tokens_per_expert (no
    host sync; tokens_per_expert may then be None); rows past the padded
    segments are left as allocated.

    Returns (output [rows, H] in inp's dtype; permuted_probs [rows] in
    probs' dtype, 0 on pad rows; row_id_map, a :class:`RowIdMap`;
    pad_offsets [E] int64, the pad rows before each expert's segment
    (always a tensor; TE gives None when nothing is padded);
    target_tokens_per_expert [E] int64, the padded rows of each expert), the
    tensors on inp's device. Gradients as :func:`moe_permute_with_probs`
    (pad rows send nothing back).
    """
    _check_inp(inp)
    mask = _mask(routing_map, inp)
    T, E = mask.shape
    _check_probs("probs", probs, T, E, inp.device)
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"align_size must be a positive int, got {align_size!r}")
    if align_size not in _ALIGNS:
        raise ValueError(f"align_size must be one of {_ALIGNS} (moeflow's plan alignments), "
                         f"got {align_size}")
    if num_out_tokens is None:
        if not isinstance(tokens_per_expert, torch.Tensor) or tuple(
                tokens_per_expert.shape) != (E,) or tokens_per_expert.is_complex():
            raise ValueError(f"tokens_per_expert must be a [num_experts={E}] tensor of counts "
                             f"(or give num_out_tokens=), got {_desc(tokens_per_expert)}")
        target = torch.ceil(tokens_per_expert.detach() / align_size) * align_size
        rows = int(target.sum().item()) if T > 0 else 0
        if rows < 0:
            raise ValueError(f"tokens_per_expert must be >= 0, got a sum of {rows} padded rows")
    else:
        rows = _count("num_out_tokens", num_out_tokens)
        if rows < 0 or rows % align_size:
            raise ValueError(f"num_out_tokens must be a multiple of align_size={align_size} "
                             f"and >= 0, got {rows}")
        if T == 0:
            rows = 0
    y, pp, row_id_map = _permute(inp, probs, mask, align_size, rows, zero_rows_of_zero_probs)
    plan = row_id_map.plan
    counts = plan.tokens_per_expert.long()
    before = torch.cumsum(counts, 0) - counts  # unpadded rows before each expert
    pad_offsets = plan.expert_row_offsets[:-1] - before
    return y, pp, row_id_map, pad_offsets, plan.padded_tokens_per_expert.long()


def moe_unpermute(inp: torch.Tensor, row_id_map: Union[RowIdMap, _ops.Plan],
                  merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[Sequence[int]] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None,
                  pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE's ``moe_unpermute`` (mask form): the permuted rows back to token
    order, each token's rows summed in float32 (in expert order, bitwise
    deterministic) and weighted by ``merging_probs`` when given.

    inp [num_out_tokens, H] float32 / float16 / bfloat16: the rows of the
    permute that made ``row_id_map`` (a :class:`RowIdMap`, or a moeflow
    ``Plan`` built from a [T, E] mask); merging_probs [T, E] float (read
    where routed); ``restore_shape`` (T, H) or None. ``probs``: TE's old
    name of merging_probs (deprecated). ``pad_offsets``: accepted for TE's
    signature and not needed (row_id_map knows the padding). Returns
    [T, H] in inp's dtype. Gradients reach inp (w * grad on each routed
    row, zero on pad rows) and merging_probs (<grad[t], row> in float32,
    zero where not routed or dropped). No host sync.
    """
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs kwarg are provided. "
                             "probs is deprecated.")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.")
        merging_probs = probs
    if map_type != "mask":
        raise ValueError(f"map_type must be 'mask', got {map_type!r}; for top-k ids use "
                         f"moeflow.ops.Plan(topk_ids, num_experts) with ops.unpermute")
    plan = row_id_map.plan if isinstance(row_id_map, RowIdMap) else row_id_map
    if not isinstance(plan, _ops.Plan) or plan.topk != plan.num_experts:
        raise ValueError("row_id_map must be the RowIdMap a moeflow.permutation permute "
                         f"returned (or a Plan of a [T, E] mask), got {_desc(row_id_map)}")
    T, E, rows = plan.num_tokens, plan.num_experts, plan.capacity_rows
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2 or inp.shape[0] != rows:
        raise ValueError(f"inp must be the permuted rows [num_out_tokens={rows}, hidden_size], "
                         f"got {_desc(inp)}")
    if inp.device != plan.dest_row.device:
        raise ValueError(f"inp must be on row_id_map's device {plan.dest_row.device}, got "
                         f"{_desc(inp)}")
    if restore_shape is not None and (len(restore_shape) != 2 or int(restore_shape[0]) != T
                                      or int(restore_shape[1]) != inp.shape[1]):
        raise ValueError(f"restore_shape must be (num_tokens, hidden_size)=({T}, "
                         f"{inp.shape[1]}), got {tuple(restore_shape)}")
    if pad_offsets is not None and not isinstance(pad_offsets, torch.Tensor):
        raise ValueError(f"pad_offsets must be None or a tensor, got {_desc(pad_offsets)}")
    p32 = None
    if merging_probs is not None:
        _check_probs("merging_probs", merging_probs, T, E, inp.device)
    if T == 0:  # no tokens (the ops' backward wants non-empty gradients)
        return inp.narrow(0, 0, 0).clone()
    if merging_probs is not None:
        p32 = merging_probs if merging_probs.dtype == torch.float32 else merging_probs.float()
    return _ops.unpermute(inp, plan, p32)
