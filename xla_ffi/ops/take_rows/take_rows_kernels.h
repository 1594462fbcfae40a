// Host launcher of take_rows' device kernel (take_rows_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include "ops/take_rows/take_rows.h"

namespace jax_ncclx {

// x: [B, X, x_row_bytes]; index: [B, M] int32; suffix: [B, M, suffix_bytes] or null; out: [B, M, out_row_bytes].
// Returns the launch's error (cudaSuccess when there is nothing to copy).
cudaError_t LaunchTakeRows(const TakeRowsShape& shape, const void* x, const int32_t* index, const void* suffix,
                           void* out, cudaStream_t stream);

}  // namespace jax_ncclx
