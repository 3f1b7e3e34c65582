"""The reference backend of moeflow.ep: dispatch and combine in plain torch
over ``torch.distributed.all_to_all_single`` (gloo on the CPU, or nccl on
GPUs), the readable oracle of moeflow/ep_reference.h's semantics and the CPU
path. It synchronises with the host (split sizes) and keeps per-slot
copies."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .ep import EpHandle, Group


class _RefState:
    """The reference's way back. Slots are (t, k), flat index t*K + k.
    send_slots [n_send] int64: the slots sent, by destination rank then slot;
    send_splits / recv_splits: rows per peer (host lists); recv_rows [n_recv]
    int64: the row of each received slot (-1: dropped); dest_rank [T, K]
    int32 (-1: unrouted), dest_row [T, K] int64 (-1: unrouted or dropped)."""
    __slots__ = ("send_slots", "send_splits", "recv_splits", "recv_rows", "dest_rank",
                 "dest_row")


def _a2a(group: Group, t: torch.Tensor, in_splits, out_splits) -> torch.Tensor:
    """Rows of t [n, ...] to the ranks (in_splits rows each); returns the
    received rows [sum(out_splits), ...] in source rank order."""
    shape = t.shape[1:]
    raw = t.contiguous().reshape(t.shape[0], shape.numel()).view(torch.uint8)
    out = torch.empty((sum(out_splits), raw.shape[1]), dtype=torch.uint8, device=t.device)
    dist.all_to_all_single(out, raw, list(out_splits), list(in_splits),
                           group=group.process_group)
    return out.view(t.dtype).reshape(-1, *shape)


def _pack(parts) -> torch.Tensor:
    """[n, ...] tensors -> one uint8 [n, bytes] tensor (one message per row)."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().reshape(n, p.shape[1:].numel()).view(torch.uint8)
                      for p in parts], 1)


def _unpack(buf: torch.Tensor, specs):
    """The inverse of _pack: specs = [(dtype, row shape), ...]."""
    out, col, n = [], 0, buf.shape[0]
    for dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            out.append(torch.empty((0, *shape), dtype=dtype, device=buf.device))
        else:
            part = buf[:, col:col + nbytes].contiguous().view(dtype)
            out.append(part.reshape(n, *shape))
        col += nbytes
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t [n, ...] as uint8 [n, bytes per row] (a view of a contiguous copy):
    rows of any dtype (FP8 included) move bit for bit as bytes."""
    return t.contiguous().reshape(t.shape[0], t.shape[1:].numel()).view(torch.uint8)


def _place(n: int, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """[n, ...] zeros of src's dtype with src's rows at the rows idx (byte
    copies)."""
    out = torch.zeros((n, _bytes(src).shape[1]), dtype=torch.uint8, device=src.device)
    out[idx] = _bytes(src)
    return out.view(src.dtype).reshape(n, *src.shape[1:])


def _ref_dispatch(group: Group, x: torch.Tensor, ids: torch.Tensor,
                  probs: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                  h: EpHandle) -> torch.Tensor:
    """Fills h; returns the received rows [capacity, H]."""
    W, L, E, K = group.world_size, group.local_experts, group.num_experts, group.topk
    cap, a, dev = group.capacity_rows, group.align, x.device
    T = x.shape[0]
    flat = ids.reshape(-1).to(torch.int64)
    bad = (flat < -1) | (flat >= E)
    first_bad = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
    flat = torch.where(bad, torch.full_like(flat, -1), flat)  # unrouted; reported at the end
    dest = torch.where(flat >= 0, flat // L, torch.full_like(flat, -1))
    routed = (flat >= 0).nonzero().squeeze(1)
    send_slots = routed[torch.argsort(dest[routed], stable=True)]
    send_counts = torch.bincount(dest[routed], minlength=W)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.process_group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    p = probs.reshape(-1)[send_slots] if probs is not None else \
        torch.zeros(send_slots.shape[0], dtype=torch.float32, device=dev)
    # Token rows (and scales) are gathered as bytes: any dtype, FP8 included.
    xb = _bytes(x)
    parts = [xb[send_slots // K], flat[send_slots] % L, p]
    specs = [(torch.uint8, (xb.shape[1],)), (torch.int64, ()), (torch.float32, ())]
    if scales is not None:  # the token's scales beside each of its rows
        sb = _bytes(scales)
        parts.append(sb[send_slots // K])
        specs.append((torch.uint8, (sb.shape[1],)))
    rx, rle, rp, *rs = _unpack(_a2a(group, _pack(parts), send_splits, recv_splits), specs)
    # The receive layout: per local expert the arrival order (source rank,
    # token, k); segments padded to align from the routed counts, then clipped
    # to the capacity (the RoutingPlan's layout_expert rule).
    n_recv = rle.shape[0]
    routed_e = torch.bincount(rle, minlength=L)
    start = torch.cumsum(routed_e, 0) - routed_e
    order = torch.argsort(rle, stable=True)
    rank_in = torch.empty(n_recv, dtype=torch.int64, device=dev)
    rank_in[order] = torch.arange(n_recv, device=dev) - start[rle[order]]
    padded_routed = (routed_e + a - 1) // a * a
    offset = (torch.cumsum(padded_routed, 0) - padded_routed).clamp(max=cap)
    kept = torch.minimum(routed_e, cap - offset)
    padded = (kept + a - 1) // a * a
    total = offset[-1:] + padded[-1:]
    recv_rows = torch.where(rank_in < kept[rle], offset[rle] + rank_in,
                            torch.full_like(rank_in, -1))
    keep = (recv_rows >= 0).nonzero().squeeze(1)
    at = recv_rows[keep]
    rows = _place(cap, at, rx[keep]).view(x.dtype)  # pad rows (and rows past total) zero
    row_probs = _place(cap, at, rp[keep])
    h.row_scales = None if scales is None else _place(cap, at, rs[0][keep]).view(scales.dtype)
    # The way back: each source learns the rows of its slots.
    back = _a2a(group, recv_rows, recv_splits, send_splits)
    dest_row = torch.full((T * K,), -1, dtype=torch.int64, device=dev)
    dest_row[send_slots] = back
    st = _RefState()
    st.send_slots, st.send_splits, st.recv_splits = send_slots, send_splits, recv_splits
    st.recv_rows = recv_rows
    st.dest_rank = dest.to(torch.int32).view(T, K)
    st.dest_row = dest_row.view(T, K)
    h._ref = st
    h.row_probs = row_probs
    h.tokens_per_expert = kept.to(torch.int32)
    h.expert_row_offsets = torch.cat([offset, total])
    h.total_rows = total
    h.overflow = (routed_e - kept).sum().reshape(1).to(torch.int32)
    if first_bad >= 0:
        raise ValueError(f"topk_ids[{first_bad // K}, {first_bad % K}] = "
                         f"{int(ids.reshape(-1)[first_bad])} is outside [-1, {E}) (num_experts="
                         f"{E}); the dispatch completed with that slot unrouted")
    return rows


def _ref_home(h: EpHandle, rows: torch.Tensor) -> torch.Tensor:
    """rows [capacity, H] on the expert ranks -> each sent slot's row at home
    [n_send, H] (zeros for dropped slots)."""
    st = h._ref
    keep = (st.recv_rows >= 0).nonzero().squeeze(1)
    vals = torch.zeros((st.recv_rows.shape[0], rows.shape[1]), dtype=rows.dtype,
                       device=rows.device)
    vals[keep] = rows[st.recv_rows[keep]]
    return _a2a(h.group, vals, st.recv_splits, st.send_splits)


def _ref_away(h: EpHandle, slot_rows: torch.Tensor) -> torch.Tensor:
    """The sent slots' rows [n_send, H] -> [capacity, H] on the expert ranks at
    the slots' rows; every other row zero."""
    st, g = h._ref, h.group
    rv = _a2a(g, slot_rows, st.send_splits, st.recv_splits)
    keep = (st.recv_rows >= 0).nonzero().squeeze(1)
    out = torch.zeros((g.capacity_rows, slot_rows.shape[1]), dtype=slot_rows.dtype,
                      device=slot_rows.device)
    out[st.recv_rows[keep]] = rv[keep]
    return out


def _ref_slots(h: EpHandle, slot_home: torch.Tensor) -> torch.Tensor:
    """[n_send, H] -> [T, K, H] float64 per slot (zeros where not sent)."""
    T, K, H = h.num_tokens, h.group.topk, slot_home.shape[1]
    full = torch.zeros((T * K, H), dtype=torch.float64, device=slot_home.device)
    full[h._ref.send_slots] = slot_home.double()
    return full.view(T, K, H)


def _ref_sum(h: EpHandle, full: torch.Tensor, w: Optional[torch.Tensor],
             out_dtype: torch.dtype) -> torch.Tensor:
    """The combine sum: per rank q ascending a float32 fma chain over k
    ascending of t's kept slots on q; the partials added in rank order. With
    the bfloat16 wire a peer's partial of several slots is rounded first."""
    st, W, K = h._ref, h.group.world_size, h.group.topk
    T, H, dev = full.shape[0], full.shape[2], full.device
    kept = st.dest_row >= 0
    wd = None if w is None else w.detach().double()
    total = torch.zeros((T, H), dtype=torch.float32, device=dev)
    have = torch.zeros((T, 1), dtype=torch.bool, device=dev)
    for q in range(W):
        on_q = kept & (st.dest_rank == q)
        partial = torch.zeros((T, H), dtype=torch.float32, device=dev)
        for k in range(K):
            prod = full[:, k] if wd is None else wd[:, k:k + 1] * full[:, k]
            # float64 holds w*y exactly: one rounding to float32, as an fma.
            partial = torch.where(on_q[:, k:k + 1], (prod + partial.double()).float(), partial)
        any_q = on_q.any(1, keepdim=True)
        if h.group.combine_wire_dtype == torch.bfloat16 and q != h.group.rank:
            several = on_q.sum(1, keepdim=True) > 1
            partial = torch.where(several, partial.bfloat16().float(), partial)
        total = torch.where(any_q, torch.where(have, total + partial, partial), total)
        have = have | any_q
    return total.to(out_dtype)
