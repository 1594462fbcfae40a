// Host launcher of take_rows' device kernel (take_rows_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include "ops/take_rows/take_rows.h"

namespace jax_ncclx {

// x: [B, X, x_row_bytes]; index: [B, M] int32; suffix: [B, M, suffix_bytes] or null; out: [B, M, out_row_bytes].
// Returns the launch's error (cudaSuccess when there is nothing to copy).
cudaError_t LaunchTakeRows(const TakeRowsShape& shape, const void* x, const int32_t* index, const void* suffix,
                           void* out, cudaStream_t stream);

// expand_rows: take_rows without a suffix, where sources ([B, X, top_k] int32) lists for each row of x the rows
// of out that take it (entries outside [0, M): none), exactly the i with index[b, i] == that row. Each row of x
// is read once; rows of out whose index is outside [0, X) are zeroed.
cudaError_t LaunchExpandRows(const TakeRowsShape& shape, int32_t top_k, const void* x, const int32_t* index,
                             const int32_t* sources, void* out, cudaStream_t stream);

}  // namespace jax_ncclx
