// The device kernel of take_rows: a warp per output row, copying in the widest unit (16, 4 or 1 bytes) that
// every row size and buffer allows, with several loads in flight per lane. (XLA's gather, which moe.dispatch
// used before, copies element by element: 2-byte units for bf16 rows.)
#include "ops/take_rows_kernels.h"

#include <algorithm>
#include <cstdint>

namespace jax_ncclx {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = 16384;
constexpr int kUnroll = 4;

// Copies n units from src to dst across the warp's lanes.
template <typename V>
__device__ __forceinline__ void WarpCopy(V* __restrict__ dst, const V* __restrict__ src, int64_t n, int lane) {
  int64_t u = lane;
  for (; u + (kUnroll - 1) * 32 < n; u += kUnroll * 32) {
    V v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = src[u + k * 32];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[u + k * 32] = v[k];
  }
  for (; u < n; u += 32) dst[u] = src[u];
}

template <typename V>
__global__ void __launch_bounds__(kThreads)
    TakeRowsKernel(TakeRowsShape shape, const V* __restrict__ x, const int32_t* __restrict__ index,
                   const V* __restrict__ suffix, V* __restrict__ out) {
  constexpr int64_t unit = sizeof(V);
  const int64_t x_units = shape.x_row_bytes / unit, take_units = shape.take_bytes / unit;
  const int64_t suffix_units = shape.suffix_bytes / unit, out_units = take_units + suffix_units;
  const int lane = threadIdx.x % 32;
  const int64_t total = shape.batch * shape.rows;
  for (int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32; r < total;
       r += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t b = r / shape.rows;
    const int32_t row = index[r];
    V* dst = out + r * out_units;
    if (row >= 0 && row < shape.source_rows) {
      WarpCopy(dst, x + (b * shape.source_rows + row) * x_units, take_units, lane);
    } else {
      for (int64_t u = lane; u < take_units; u += 32) dst[u] = V{};
    }
    if (suffix != nullptr) WarpCopy(dst + take_units, suffix + r * suffix_units, suffix_units, lane);
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
  const int64_t total = shape.batch * shape.rows;
  const int64_t blocks = std::min((total + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  TakeRowsKernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      shape, static_cast<const V*>(x), index, static_cast<const V*>(suffix), static_cast<V*>(out));
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
