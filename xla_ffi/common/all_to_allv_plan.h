// The send plan of all_to_allv_dynamic, shared by the CPU handler and the CUDA kernels so that both clamp
// bad counts the same documented way:
//   * rows for peer 0 come first in the input, then peer 1, ...; inside a peer, chunk 0, chunk 1, ...;
//   * a negative count sends nothing (its magnitude is reported as dropped);
//   * counts running past the end of the input's num_rows rows are cut at the end of the input;
//   * each peer takes at most `capacity` rows, chunk after chunk; rows past that are dropped.
// So the rows a peer receives are always a contiguous prefix of the rows meant for it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NCCLX_HOST_DEVICE __host__ __device__
#else
#define NCCLX_HOST_DEVICE
#endif

namespace jax_ncclx {

// counts: [num_peers * num_chunks] requested rows (row-major, peer-major).
// delivered_chunks: [num_peers * num_chunks] rows of each chunk that reach the peer (these become the
//   peer's recv_counts). first_row / delivered / dropped: [num_peers] input row where the rows for the
//   peer start, how many rows it receives, and how many requested rows did not reach it.
NCCLX_HOST_DEVICE inline void PlanSends(const int32_t* counts, int64_t num_peers, int64_t num_chunks,
                                        int64_t num_rows, int64_t capacity, int32_t* delivered_chunks,
                                        int64_t* first_row, int64_t* delivered, int32_t* dropped) {
  int64_t consumed = 0;  // input rows claimed by the chunks walked so far
  for (int64_t peer = 0; peer < num_peers; ++peer) {
    first_row[peer] = consumed;
    int64_t room = capacity;
    int64_t requested = 0;
    int64_t sent = 0;
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const int64_t count = counts[peer * num_chunks + chunk];
      requested += count < 0 ? -count : count;
      int64_t rows = count < 0 ? 0 : count;
      rows = rows < num_rows - consumed ? rows : num_rows - consumed;  // cut at the end of the input
      consumed += rows;
      const int64_t fits = rows < room ? rows : room;                  // cut at the peer's capacity
      room -= fits;
      sent += fits;
      delivered_chunks[peer * num_chunks + chunk] = static_cast<int32_t>(fits);
    }
    delivered[peer] = sent;
    const int64_t lost = requested - sent;
    dropped[peer] = static_cast<int32_t>(lost < INT32_MAX ? lost : INT32_MAX);
  }
}

}  // namespace jax_ncclx
