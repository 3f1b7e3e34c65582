// Receive layout of expert-parallel dispatch from the count matrix, shared by
// the host and the device (the fused NVLink dispatch of
// docs/ep.md computes it on every rank after the counts are
// exchanged, with no host round trip).
//
// counts[s * E + g]: slots of source rank s routed to global expert g.
// Rank q owns experts [q*L, (q+1)*L), L = E / W. Its receive layout is the
// reference's (moeflow/ep_reference.h): local experts in order, each padded to
// `align`, clipped by `capacity` (layout_expert); inside expert g the rows of
// source s start after those of the sources before it, so that rows are in
// (source rank, token, k) order. A slot of source s whose rank among s's
// slots to g (in (token, k) order) is r lands on row first_row(s, g) + r of
// rank g / L when r < fit(s, g), and is dropped otherwise.
#pragma once

#include <cstdint>

#include "core/backends.h"  // MOEFLOW_HD, layout_expert

namespace moeflow {

struct EpSlotRange {
  int64_t first_row;  // row of the source's first slot to this expert on its rank
  int64_t fit;        // how many of the source's slots to this expert are kept
};

// Slots routed to global expert g by all sources.
MOEFLOW_HD inline int64_t ep_routed(const int32_t* counts, int W, int E, int g) {
  int64_t routed = 0;
  for (int s = 0; s < W; ++s) routed += counts[s * E + g];
  return routed;
}

// Where a source sends its `mine` slots to an expert that receives `routed`
// slots in all, `before` of them from the sources before it, and whose segment
// would start at `prefix` (the padded routed counts of the experts before it
// on its rank) without the capacity.
MOEFLOW_HD inline EpSlotRange ep_slot_range_at(int64_t routed, int64_t prefix, int64_t before,
                                               int64_t mine, int64_t capacity, int align) {
  const ExpertLayout l = layout_expert(routed, prefix, capacity, align);
  EpSlotRange r;
  r.first_row = l.offset + before;
  const int64_t room = l.kept - before;
  r.fit = room <= 0 ? 0 : (room < mine ? room : mine);
  return r;
}

// Where source rank `s` sends its slots to global expert g. O(W * L).
MOEFLOW_HD inline EpSlotRange ep_slot_range(const int32_t* counts, int W, int E, int s, int g,
                                            int64_t capacity, int align) {
  const int L = E / W, q = g / L, e = g % L;
  int64_t prefix = 0;
  for (int e2 = 0; e2 < e; ++e2)
    prefix += (ep_routed(counts, W, E, q * L + e2) + align - 1) / align * align;
  int64_t before = 0;
  for (int s2 = 0; s2 < s; ++s2) before += counts[s2 * E + g];
  return ep_slot_range_at(ep_routed(counts, W, E, g), prefix, before, counts[s * E + g], capacity,
                          align);
}

// The receive plan of rank q: kept rows per local expert, segment offsets
// (offsets[L] = rows used) and the dropped slot count.
MOEFLOW_HD inline void ep_recv_layout(const int32_t* counts, int W, int E, int q, int64_t capacity,
                                      int align, int32_t* kept, int64_t* offsets,
                                      int64_t* dropped) {
  const int L = E / W;
  int64_t prefix = 0, drop = 0, used = 0;
  for (int e = 0; e < L; ++e) {
    int64_t routed = 0;
    for (int s = 0; s < W; ++s) routed += counts[s * E + q * L + e];
    const ExpertLayout l = layout_expert(routed, prefix, capacity, align);
    kept[e] = l.kept;
    offsets[e] = l.offset;
    used = l.offset + l.padded;
    drop += routed - l.kept;
    prefix += (routed + align - 1) / align * align;
  }
  offsets[L] = L > 0 ? used : 0;
  *dropped = drop;
}

}  // namespace moeflow
