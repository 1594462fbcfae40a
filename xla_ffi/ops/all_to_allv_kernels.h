// Host launchers of the device kernels of all_to_allv_dynamic: plan the sends, pack the padded send
// buffer, and compact the padded receive buffer into the packed output. Each launcher queues its work on
// `stream` and returns cudaGetLastError() of the launch (cudaSuccess when there is nothing to launch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ncclx {

// Sizes shared by the three kernels. A row is the trailing feature dims of one input row, as raw bytes.
struct AllToAllvShape {
  int64_t batch = 0;       // B
  int64_t num_peers = 0;   // N (communicator size)
  int64_t num_chunks = 0;  // K (count entries per peer)
  int64_t num_rows = 0;    // S (input rows per batch element)
  int64_t capacity = 0;    // C (rows each peer can take)
  int64_t row_bytes = 0;
};

// One thread per batch element runs PlanSends on counts[b] ([B, N, K] int32), writing delivered_chunks
// [B, N, K], first_row [B, N], delivered [B, N] and dropped [B, N].
cudaError_t LaunchPlanSends(const AllToAllvShape& shape, const int32_t* counts, int32_t* delivered_chunks,
                            int64_t* first_row, int64_t* delivered, int32_t* dropped, cudaStream_t stream);

// Fills send [B, N, C, row_bytes]: row (b, j, c) is x[b, first_row[b, j] + c] when c < delivered[b, j],
// else zero bytes. x is [B, S, row_bytes].
cudaError_t LaunchPackRows(const AllToAllvShape& shape, const void* x, const int64_t* first_row,
                           const int64_t* delivered, void* send, cudaStream_t stream);

// Builds y [B, N * C, row_bytes] from recv [B, N, C, row_bytes], where source j sent
// sum_k recv_counts[b, j, k] rows followed by zero rows: y[b] holds the rows of source 0, then those of
// source 1, ..., then zeros.
cudaError_t LaunchCompactRows(const AllToAllvShape& shape, const void* recv, const int32_t* recv_counts,
                              void* y, cudaStream_t stream);

}  // namespace jax_ncclx
