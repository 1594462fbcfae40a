// The device kernel of take_rows: each warp copies one chunk of a row at a time (kUnroll units per lane, all
// loads in flight before the stores), in the widest unit (16, 4 or 1 bytes) that every row size and buffer
// allows. Chunks make a few rows still spread over many warps and SMs. The warps walk the chunks column-major
// (chunk 0 of every row, then chunk 1, ...): moe's expert-major rows read each received row once per local
// expert it goes to, and one chunk column of the received rows fits in L2 where the whole rows do not.
// (XLA's gather, which moe.dispatch used before, copies element by element: 2-byte units for bf16 rows.)
#include "ops/take_rows/take_rows_kernels.h"

#include <algorithm>
#include <cstdint>

namespace jax_ncclx {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = 16384;
constexpr int kUnroll = 4;
constexpr int64_t kChunkUnits = 32 * kUnroll;

// Chunks per output row: those of the part taken from x, then those of the suffix.
__host__ __device__ inline int64_t TakeChunks(const TakeRowsShape& s, int64_t unit) {
  return (s.take_bytes / unit + kChunkUnits - 1) / kChunkUnits;
}
__host__ __device__ inline int64_t RowChunks(const TakeRowsShape& s, int64_t unit) {
  return TakeChunks(s, unit) + (s.suffix_bytes / unit + kChunkUnits - 1) / kChunkUnits;
}

// Units [lo, min(lo + kChunkUnits, n)) of src to dst (src null: zeros), across the warp's lanes.
template <typename V>
__device__ __forceinline__ void CopyChunk(V* __restrict__ dst, const V* __restrict__ src, int64_t lo, int64_t n,
                                          int lane) {
  V v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t u = lo + lane + k * 32;
    v[k] = src != nullptr && u < n ? src[u] : V{};
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t u = lo + lane + k * 32;
    if (u < n) dst[u] = v[k];
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads)
    TakeRowsKernel(TakeRowsShape shape, const V* __restrict__ x, const int32_t* __restrict__ index,
                   const V* __restrict__ suffix, V* __restrict__ out) {
  constexpr int64_t unit = sizeof(V);
  const int64_t x_units = shape.x_row_bytes / unit, take_units = shape.take_bytes / unit;
  const int64_t suffix_units = shape.suffix_bytes / unit, out_units = take_units + suffix_units;
  const int64_t take_chunks = TakeChunks(shape, unit);
  const int64_t rows = shape.batch * shape.rows, items = rows * RowChunks(shape, unit);
  const int lane = threadIdx.x % 32;
  for (int64_t item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32; item < items;
       item += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t chunk = item / rows, r = item % rows;
    V* dst = out + r * out_units;
    if (chunk < take_chunks) {
      const int64_t b = r / shape.rows;
      const int32_t row = index[r];
      const V* src = row >= 0 && row < shape.source_rows ? x + (b * shape.source_rows + row) * x_units : nullptr;
      CopyChunk(dst, src, chunk * kChunkUnits, take_units, lane);
    } else {
      CopyChunk(dst + take_units, suffix + r * suffix_units, (chunk - take_chunks) * kChunkUnits, suffix_units, lane);
    }
  }
}

bool FitsUnit(int64_t width, const TakeRowsShape& s, const void* x, const void* suffix, const void* out) {
  auto aligned = [width](const void* p) { return reinterpret_cast<uintptr_t>(p) % width == 0; };
  return s.x_row_bytes % width == 0 && s.take_bytes % width == 0 && s.suffix_bytes % width == 0 && aligned(x) &&
         aligned(suffix) && aligned(out);
}

template <typename V>
cudaError_t Launch(const TakeRowsShape& shape, const void* x, const int32_t* index, const void* suffix, void* out,
                   cudaStream_t stream) {
  const int64_t items = shape.batch * shape.rows * RowChunks(shape, sizeof(V));
  const int64_t blocks = std::min((items + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  TakeRowsKernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(shape, static_cast<const V*>(x), index,
                                                                            static_cast<const V*>(suffix),
                                                                            static_cast<V*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchTakeRows(const TakeRowsShape& shape, const void* x, const int32_t* index, const void* suffix,
                           void* out, cudaStream_t stream) {
  if (shape.batch * shape.rows == 0 || shape.out_row_bytes() == 0) return cudaSuccess;
  if (FitsUnit(16, shape, x, suffix, out)) return Launch<uint4>(shape, x, index, suffix, out, stream);
  if (FitsUnit(4, shape, x, suffix, out)) return Launch<uint32_t>(shape, x, index, suffix, out, stream);
  return Launch<uint8_t>(shape, x, index, suffix, out, stream);
}

}  // namespace jax_ncclx
