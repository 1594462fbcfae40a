// The send plan of all_to_allv_dynamic, shared by the CPU handler and the CUDA kernels so that both clamp
// bad counts the same documented way:
//   * rows for peer 0 come first in the input, then peer 1, ...; inside a peer, chunk 0, chunk 1, ...;
//   * a negative count sends nothing (its magnitude is reported as dropped);
//   * counts running past the end of the input's num_rows rows are cut at the end of the input;
//   * each peer takes at most `capacity` rows, chunk after chunk; rows past that are dropped.
// So the rows a peer receives are always a contiguous prefix of the rows meant for it.
// The rows are those of the send buffer: x itself, or, with a send_rows index, row s is x[send_rows[s]]
// (SourceRow), gathered on the fly by the kernel that sends it.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace jax_ncclx {

// The count an injected kCorruptCounts fault (monitor.h) puts in place of element `i` of the send counts:
// alternately a large negative count and one far beyond any capacity, so that both clamps are exercised.
NCCLX_HOST_DEVICE inline int32_t CorruptedCount(int32_t count, int64_t i) {
  const int32_t magnitude = (count < 0 ? 0 : count % 1000) + (1 << 29);
  return i % 2 == 0 ? -magnitude : magnitude;
}

// Where one peer's rows sit in the input and how many reach it.
struct PeerPlan {
  int64_t first_row = 0;  // input row where the rows for the peer start
  int64_t delivered = 0;  // rows it receives (at most capacity)
  int32_t dropped = 0;    // requested rows that do not reach it
};

// The plan for `peer` alone, in O(num_peers * num_chunks) time and O(1) space, so that a device thread can
// plan one peer without scratch memory. counts: [num_peers * num_chunks] requested rows (peer-major).
// emit(chunk, rows) is called for each of the peer's chunks with the rows of it that reach the peer (these
// become the peer's recv_counts).
template <typename Emit>
NCCLX_HOST_DEVICE inline PeerPlan PlanPeer(const int32_t* counts, int64_t num_chunks, int64_t num_rows,
                                           int64_t capacity, int64_t peer, Emit emit) {
  // Rows are consumed in order and cut at the end of the input, so the rows claimed before this peer are
  // min(num_rows, sum of the earlier positive counts).
  int64_t claimed = 0;
  for (int64_t i = 0; i < peer * num_chunks; ++i) claimed += counts[i] < 0 ? 0 : counts[i];
  PeerPlan plan;
  plan.first_row = claimed < num_rows ? claimed : num_rows;
  int64_t consumed = plan.first_row;
  int64_t room = capacity;
  int64_t requested = 0;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t count = counts[peer * num_chunks + chunk];
    requested += count < 0 ? -count : count;
    int64_t rows = count < 0 ? 0 : count;
    rows = rows < num_rows - consumed ? rows : num_rows - consumed;  // cut at the end of the input
    consumed += rows;
    const int64_t fits = rows < room ? rows : room;                  // cut at the peer's capacity
    room -= fits;
    plan.delivered += fits;
    emit(chunk, static_cast<int32_t>(fits));
  }
  const int64_t lost = requested - plan.delivered;
  plan.dropped = static_cast<int32_t>(lost < INT32_MAX ? lost : INT32_MAX);
  return plan;
}

#if defined(__CUDACC__)
// PlanPeer's plan made by one warp, which every lane of it calls with the same arguments: lane l takes chunks
// l, l + 32, ... The walk's cuts follow from prefix sums: through chunk k the rows consumed are
// min(num_rows, first_row + the positive counts of chunks 0..k), and the rows delivered are
// min(capacity, those consumed - first_row). So a chunk delivers the difference of two such values, and the
// warp needs a scan where PlanPeer's one thread walks the counts one after another (up to N * K of them,
// each a dependent shared-memory read). That walk costs ~90 cycles per chunk, the warp ~15 shuffles whatever
// the counts, so the warp pays off from a few chunks per peer on. Every lane returns the plan; the lane of each
// chunk writes the rows of it that reach the peer into delivered_chunks[chunk] (when not null).
__device__ inline PeerPlan WarpPlanPeer(const int32_t* counts, int64_t num_chunks, int64_t num_rows, int64_t capacity,
                                        int64_t peer, int32_t* delivered_chunks) {
  constexpr unsigned kAllLanes = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  auto warp_sum = [](int64_t v) {
    for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(kAllLanes, v, d);
    return v;
  };
  int64_t claimed = 0;
  for (int64_t i = lane; i < peer * num_chunks; i += 32) claimed += counts[i] < 0 ? 0 : counts[i];
  if (peer > 0) claimed = warp_sum(claimed);
  PeerPlan plan;
  plan.first_row = claimed < num_rows ? claimed : num_rows;
  auto delivered_through = [&](int64_t positive) {  // rows delivered once `positive` rows were asked for
    const int64_t consumed = plan.first_row + positive < num_rows ? plan.first_row + positive : num_rows;
    return consumed - plan.first_row < capacity ? consumed - plan.first_row : capacity;
  };
  int64_t positive = 0;  // positive counts of the chunks of the earlier passes
  int64_t requested = 0;
  for (int64_t first = 0; first < num_chunks; first += 32) {
    const int64_t chunk = first + lane;
    const int64_t count = chunk < num_chunks ? counts[peer * num_chunks + chunk] : 0;
    requested += count < 0 ? -count : count;
    const int64_t own = count < 0 ? 0 : count;
    int64_t through = own;  // inclusive scan over the pass's lanes
    for (int d = 1; d < 32; d *= 2) {
      const int64_t below = __shfl_up_sync(kAllLanes, through, d);
      if (lane >= d) through += below;
    }
    if (chunk < num_chunks && delivered_chunks != nullptr) {
      delivered_chunks[chunk] = static_cast<int32_t>(delivered_through(positive + through) -
                                                     delivered_through(positive + through - own));
    }
    positive += __shfl_sync(kAllLanes, through, 31);
  }
  plan.delivered = delivered_through(positive);
  const int64_t lost = warp_sum(requested) - plan.delivered;
  plan.dropped = static_cast<int32_t>(lost < INT32_MAX ? lost : INT32_MAX);
  return plan;
}
#endif  // defined(__CUDACC__)

// PlanPeer for every peer. delivered_chunks: [num_peers * num_chunks]; first_row / delivered / dropped:
// [num_peers].
NCCLX_HOST_DEVICE inline void PlanSends(const int32_t* counts, int64_t num_peers, int64_t num_chunks, int64_t num_rows,
                                        int64_t capacity, int32_t* delivered_chunks, int64_t* first_row,
                                        int64_t* delivered, int32_t* dropped) {
  for (int64_t peer = 0; peer < num_peers; ++peer) {
    int32_t* peer_chunks = delivered_chunks + peer * num_chunks;
    const PeerPlan plan = PlanPeer(counts, num_chunks, num_rows, capacity, peer,
                                   [peer_chunks](int64_t chunk, int32_t rows) { peer_chunks[chunk] = rows; });
    first_row[peer] = plan.first_row;
    delivered[peer] = plan.delivered;
    dropped[peer] = plan.dropped;
  }
}

// The row of x that send row `s` of batch element `b` takes, as a flat row of x [B, source_rows, ...]: s
// itself without an index, else send_rows[b, s] ([B, num_rows] int32); -1 (send a zero row) when the index
// falls outside x.
NCCLX_HOST_DEVICE inline int64_t SourceRow(const int32_t* send_rows, int64_t num_rows, int64_t source_rows, int64_t b,
                                           int64_t s) {
  if (send_rows == nullptr) return b * source_rows + s;
  const int64_t row = send_rows[b * num_rows + s];
  return row >= 0 && row < source_rows ? b * source_rows + row : -1;
}

}  // namespace jax_ncclx
