// The device kernels of take_rows and expand_rows: each warp copies one chunk of a row at a time (kUnroll units
// per lane, all loads in flight before the stores), in the widest unit (16, 4 or 1 bytes) that every row size
// and buffer allows. Chunks make a few rows still spread over many warps and SMs. take_rows' warps walk the
// output's chunks column-major (chunk 0 of every row, then chunk 1, ...), so that a source row taken by many
// output rows is read from L2 while one chunk column of the sources fits there. expand_rows walks the source
// rows instead, and stores each chunk to every output row that takes it: one read per source row, whatever
// the L2 holds. (XLA's gather copies element by element: 2-byte units for bf16 rows.) encode_rows gives each
// warp kQuantizeBlocks blocks of 128 values of a token row (QuantizeBlocks).
#include "ops/take_rows/take_rows_kernels.h"

#include "common/wire_rows.cuh"

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
__host__ __device__ inline int64_t Chunks(int64_t units) { return (units + kChunkUnits - 1) / kChunkUnits; }
__host__ __device__ inline int64_t TakeChunks(const TakeRowsShape& s, int64_t unit) {
  return Chunks(s.take_bytes / unit);
}
__host__ __device__ inline int64_t RowChunks(const TakeRowsShape& s, int64_t unit) {
  return TakeChunks(s, unit) + Chunks(s.suffix_bytes / unit);
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

// How expand_rows reads unit `at` of source row r: as it is (Copied: 16, 4 or 1 bytes), or as a 16-byte vector
// of Token dequantized from a row on moe's 8-bit wire (Decoded).
template <typename V>
struct Copied {
  using Unit = V;
  const V* x;
  int64_t x_units;  // units per source row
  __device__ __forceinline__ V Load(int64_t r, int64_t at) const { return x[r * x_units + at]; }
};
template <typename Token, __nv_fp8_interpretation_t kFormat>
struct Decoded {
  using Unit = uint4;
  const uint8_t* x;
  int64_t x_row_bytes, hidden;  // a source row's bytes (the wire row, then its suffix); H
  __device__ __forceinline__ uint4 Load(int64_t r, int64_t at) const {
    return DequantizeVector<Token, kFormat>(x + r * x_row_bytes, at, hidden);
  }
};

// expand_rows' work items: B * X source rows of chunks, then the output rows in groups of 32 (one index per
// lane) of chunks. A group checks 32 indices with one load and zeroes only the rows out of range, where an item
// per output row and chunk would cost a dependent load for every chunk of every row, most of them written.
__host__ __device__ inline int64_t ExpandItems(const TakeRowsShape& s, int64_t chunks) {
  return (s.batch * s.source_rows + (s.batch * s.rows + 31) / 32) * chunks;
}

// expand_rows: the rows with an index in range are written by walking x's rows (each read once and stored to
// the outputs that `sources` lists for it), the rest by zeroing. Each warp takes one item; lane j < k holds the
// row's j-th output for the store loop. out_units: units per output row.
template <typename Source>
__global__ void __launch_bounds__(kThreads)
    ExpandRowsKernel(TakeRowsShape shape, int32_t top_k, Source source, int64_t out_units,
                     const int32_t* __restrict__ index, const int32_t* __restrict__ sources,
                     typename Source::Unit* __restrict__ out) {
  using V = typename Source::Unit;
  const int64_t chunks = Chunks(out_units);
  const int64_t x_rows = shape.batch * shape.source_rows, out_rows = shape.batch * shape.rows;
  const int64_t items = ExpandItems(shape, chunks);
  const int lane = threadIdx.x % 32;
  for (int64_t item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32; item < items;
       item += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t r = item / chunks, lo = (item - r * chunks) * kChunkUnits;
    if (r >= x_rows) {  // 32 output rows: zeros in those whose index is out of range
      const int64_t o = (r - x_rows) * 32 + lane;
      const int32_t row = o < out_rows ? index[o] : 0;
      for (unsigned empty = __ballot_sync(0xffffffffu, o < out_rows && (row < 0 || row >= shape.source_rows));
           empty != 0; empty &= empty - 1) {
        CopyChunk<V>(out + ((r - x_rows) * 32 + __ffs(empty) - 1) * out_units, nullptr, lo, out_units, lane);
      }
      continue;
    }
    const int64_t b = r / shape.source_rows;
    V v[kUnroll];
    bool loaded = false;
    for (int32_t first = 0; first < top_k; first += 32) {
      const int32_t j = first + lane;
      const int32_t to = j < top_k ? sources[r * top_k + j] : -1;
      unsigned going = __ballot_sync(0xffffffffu, to >= 0 && to < shape.rows);
      if (going != 0 && !loaded) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t at = lo + lane + u * 32;
          if (at < out_units) v[u] = source.Load(r, at);
        }
        loaded = true;
      }
      for (; going != 0; going &= going - 1) {
        const int64_t o = b * shape.rows + __shfl_sync(0xffffffffu, to, __ffs(going) - 1);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t at = lo + lane + u * 32;
          if (at < out_units) out[o * out_units + at] = v[u];
        }
      }
    }
  }
}

template <typename Source>
cudaError_t LaunchExpand(const TakeRowsShape& shape, int32_t top_k, Source source, int64_t out_units,
                         const int32_t* index, const int32_t* sources, void* out, cudaStream_t stream) {
  const int64_t items = ExpandItems(shape, Chunks(out_units));
  const int64_t blocks = std::min((items + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  ExpandRowsKernel<Source>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(shape, top_k, source, out_units, index, sources,
                                                               static_cast<typename Source::Unit*>(out));
  return cudaGetLastError();
}

template <__nv_fp8_interpretation_t kFormat>
cudaError_t LaunchDecodedExpand(const TakeRowsShape& shape, int32_t top_k, FloatType token, const void* x,
                                const int32_t* index, const int32_t* sources, void* out, cudaStream_t stream) {
  const auto* bytes = static_cast<const uint8_t*>(x);
  const int64_t units = shape.take_bytes / 16;
  switch (token) {
    case FloatType::kF32:
      return LaunchExpand(shape, top_k, Decoded<float, kFormat>{bytes, shape.x_row_bytes, shape.take_bytes / 4}, units,
                          index, sources, out, stream);
    case FloatType::kBF16:
      return LaunchExpand(shape, top_k, Decoded<__nv_bfloat16, kFormat>{bytes, shape.x_row_bytes, shape.take_bytes / 2},
                          units, index, sources, out, stream);
    case FloatType::kF16:
      return LaunchExpand(shape, top_k, Decoded<__half, kFormat>{bytes, shape.x_row_bytes, shape.take_bytes / 2}, units,
                          index, sources, out, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename Token, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads)
    EncodeRowsKernel(int64_t rows, int64_t hidden, const Token* __restrict__ x, uint8_t* __restrict__ out) {
  const int32_t blocks = static_cast<int32_t>(hidden / kMoeWireBlock);
  const int32_t groups = (blocks + kQuantizeBlocks - 1) / kQuantizeBlocks;
  const int64_t wire_bytes = hidden + 4 * int64_t{blocks};
  const int lane = threadIdx.x % 32;
  for (int64_t item = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32; item < rows * groups;
       item += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t r = item / groups;
    const int32_t first = static_cast<int32_t>(item - r * groups) * kQuantizeBlocks;
    QuantizeBlocks<Token, kFormat>(out + r * wire_bytes, x + r * hidden, first, blocks, hidden, lane);
  }
}

template <__nv_fp8_interpretation_t kFormat>
cudaError_t LaunchEncode(int64_t rows, int64_t hidden, FloatType token, const void* x, void* out, cudaStream_t stream) {
  const int64_t groups = (hidden / kMoeWireBlock + kQuantizeBlocks - 1) / kQuantizeBlocks;
  const auto blocks = static_cast<unsigned>(
      std::min((rows * groups + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks));
  auto* bytes = static_cast<uint8_t*>(out);
  switch (token) {
    case FloatType::kF32:
      EncodeRowsKernel<float, kFormat>
          <<<blocks, kThreads, 0, stream>>>(rows, hidden, static_cast<const float*>(x), bytes);
      break;
    case FloatType::kBF16:
      EncodeRowsKernel<__nv_bfloat16, kFormat>
          <<<blocks, kThreads, 0, stream>>>(rows, hidden, static_cast<const __nv_bfloat16*>(x), bytes);
      break;
    case FloatType::kF16:
      EncodeRowsKernel<__half, kFormat>
          <<<blocks, kThreads, 0, stream>>>(rows, hidden, static_cast<const __half*>(x), bytes);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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

cudaError_t LaunchExpandRows(const TakeRowsShape& shape, int32_t top_k, const void* x, const int32_t* index,
                             const int32_t* sources, void* out, cudaStream_t stream) {
  if (shape.batch * shape.rows == 0 || shape.take_bytes == 0) return cudaSuccess;
  auto copied = [&](auto unit) {
    using V = decltype(unit);
    return LaunchExpand(shape, top_k, Copied<V>{static_cast<const V*>(x), shape.x_row_bytes / int64_t{sizeof(V)}},
                        shape.take_bytes / int64_t{sizeof(V)}, index, sources, out, stream);
  };
  if (FitsUnit(16, shape, x, nullptr, out)) return copied(uint4{});
  if (FitsUnit(4, shape, x, nullptr, out)) return copied(uint32_t{});
  return copied(uint8_t{});
}

cudaError_t LaunchExpandWireRows(const TakeRowsShape& shape, int32_t top_k, MoeWire wire, FloatType token,
                                 const void* x, const int32_t* index, const int32_t* sources, void* out,
                                 cudaStream_t stream) {
  if (shape.batch * shape.rows == 0 || shape.take_bytes == 0) return cudaSuccess;  // no work: a grid of 0 fails
  // Whole 16-byte output vectors, and aligned 8-byte loads of values and 4-byte loads of scales (the handler
  // checks the shapes; this keeps the kernel's loads legal whatever called it).
  if (shape.take_bytes % 16 != 0 || shape.x_row_bytes % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  switch (wire) {
    case MoeWire::kE4M3:
      return LaunchDecodedExpand<__NV_E4M3>(shape, top_k, token, x, index, sources, out, stream);
    case MoeWire::kE5M2:
      return LaunchDecodedExpand<__NV_E5M2>(shape, top_k, token, x, index, sources, out, stream);
    case MoeWire::kNone:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchEncodeRows(int64_t rows, int64_t hidden, MoeWire wire, FloatType token, const void* x, void* out,
                             cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;  // no work: a grid of 0 fails
  // Aligned 16-byte (float) or 8-byte token loads; 4-byte stores of values and scales (the handler checks the
  // shapes; this keeps the kernel's accesses legal whatever called it).
  if (hidden % kMoeWireBlock != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  switch (wire) {
    case MoeWire::kE4M3:
      return LaunchEncode<__NV_E4M3>(rows, hidden, token, x, out, stream);
    case MoeWire::kE5M2:
      return LaunchEncode<__NV_E5M2>(rows, hidden, token, x, out, stream);
    case MoeWire::kNone:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_ncclx
