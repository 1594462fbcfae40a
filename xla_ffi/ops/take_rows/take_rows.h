// take_rows: out[b, i] = the first take_bytes of row index[b, i] of x[b] (zeros when the index falls outside
// x), followed by row i of an optional suffix. The row copies of jax_ncclx.moe.dispatch (specified in
// jax_ncclx/_src/ops/take_rows.py), as a CPU handler (take_rows_cpu.cc) and a CUDA kernel (take_rows_kernels.cu)
// that copies 16 bytes per lane where the rows allow it. Rows are raw bytes: any dtype.
// expand_rows is take_rows without a suffix, given also the inverse of index (for each row of x, the rows of
// out that take it): the CUDA kernel then reads each row of x once, however many rows of out take it. It can
// also dequantize rows on moe.dispatch's 8-bit wire as it reads them (common/wire_rows.cuh). encode_rows
// quantizes token rows onto that wire, in one pass over them.
// This header is plain C++: the CPU module, the CUDA handler and the device code all include it.
#pragma once

#include <cstdint>

namespace jax_ncclx {

struct TakeRowsShape {
  int64_t batch = 0;         // B
  int64_t source_rows = 0;   // X, rows of x per batch element
  int64_t rows = 0;          // M, rows taken (index entries) per batch element
  int64_t x_row_bytes = 0;   // bytes of a row of x
  int64_t take_bytes = 0;    // bytes taken from the front of each row of x (<= x_row_bytes)
  int64_t suffix_bytes = 0;  // bytes of a suffix row (0: no suffix)
  int64_t out_row_bytes() const { return take_bytes + suffix_bytes; }
};

}  // namespace jax_ncclx
