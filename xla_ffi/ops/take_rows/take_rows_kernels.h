// Host launcher of take_rows' device kernel (take_rows_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/contract.h"
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

// expand_rows of rows on moe's 8-bit wire (x: [B, X, x_row_bytes] uint8, each H bytes of `wire`, then H / 128
// float32 scales), dequantized to token ([B, M, take_bytes], take_bytes = H * the token's size) as they are
// stored. Needs take_bytes a multiple of 16, x_row_bytes of 8, and 16-byte aligned buffers.
cudaError_t LaunchExpandWireRows(const TakeRowsShape& shape, int32_t top_k, MoeWire wire, FloatType token,
                                 const void* x, const int32_t* index, const int32_t* sources, void* out,
                                 cudaStream_t stream);

// encode_rows: `rows` token rows of `hidden` values of `token` (x, 16-byte aligned) quantized onto moe's 8-bit
// wire (out: rows of hidden + 4 * hidden / kMoeWireBlock bytes), with the dispatch kernel's arithmetic.
cudaError_t LaunchEncodeRows(int64_t rows, int64_t hidden, MoeWire wire, FloatType token, const void* x, void* out,
                             cudaStream_t stream);

}  // namespace jax_ncclx
