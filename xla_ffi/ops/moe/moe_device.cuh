// Device helpers the MoE kernels share (the routing kernels, and moe.dispatch's kernel, which does their work
// in one launch, moe.combine's and the masked layout's): fast division by a call's fixed divisors, how rows are
// shared out among warps, lane masks, block lookups and scans, a walk over a segment of pairs, where a call's
// slots start, and 16-byte vectors as float32 lanes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "common/device_sync.cuh"
#include "common/symmetric_layout.h"
#include "ops/moe/moe_routing.h"

namespace jax_ncclx {

// Division of a non-negative int32 by a divisor fixed for the call, set up on the host: a multiply-high, an
// add and a shift (Granlund and Montgomery) instead of an integer division's ~20 dependent instructions,
// which every index of these kernels would wait for (with the shapes' divisors known at compile time, the
// kernels at T = 16 took 1.0-1.5 µs less, kernel-only on one H200).
struct Divisor {
  uint32_t divisor = 1, multiplier = 0, shift = 0;
  Divisor() = default;
  // A zero divisor (an empty dimension, which the kernels never divide by) is taken as 1.
  explicit Divisor(int64_t d) : divisor(static_cast<uint32_t>(std::max<int64_t>(d, 1))) {
    while ((uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor) / divisor + 1);
  }
  __device__ int32_t Div(int32_t n) const {
    return static_cast<int32_t>((__umulhi(static_cast<uint32_t>(n), multiplier) + static_cast<uint32_t>(n)) >> shift);
  }
  __device__ int32_t Mod(int32_t n) const { return n - Div(n) * static_cast<int32_t>(divisor); }
};

// A unit of Units: its row and the vectors [lo, hi) of that row it covers.
struct Piece {
  int64_t row, lo, hi;
};

// How the NVLink MoE kernels share rows out: warp-sized units of (row, piece of its vectors), as many pieces
// per row as it takes to give every warp of the grid work, so a few decode rows still spread over every SM
// while prefill rows go whole to a warp, which reads the row's indices once. Units are numbered row-major:
//   for (int64_t unit = first_warp; unit < units.count(); unit += warps) { const Piece piece = units.At(unit); ... }
// A piece holds at least `least` vectors: 32 for a vector per lane; 1 where a "vector" is a whole warp's step.
struct Units {
  int64_t rows, vectors;
  int64_t pieces;     // per row
  int64_t piece_len;  // vectors per piece
  // With whole-warp units (least 1) no warp takes two pieces while rows fit the grid: a warp's second piece
  // would wait out its own round trips after the first.
  __device__ Units(int64_t rows, int64_t vectors, int64_t warps, int64_t least = 32) : rows(rows), vectors(vectors) {
    const int64_t most = max(int64_t{1}, (vectors + least - 1) / least);
    const int64_t per_row = least == 1 ? warps / max(rows, int64_t{1}) : (warps + rows - 1) / max(rows, int64_t{1});
    pieces = rows == 0 ? 1 : min(most, max(int64_t{1}, per_row));
    piece_len = (vectors + pieces - 1) / pieces;
    if (least == 1) pieces = (vectors + piece_len - 1) / max(piece_len, int64_t{1});  // no empty piece
  }
  __device__ int64_t count() const { return rows * pieces; }
  __device__ Piece At(int64_t unit) const {
    const int64_t row = unit / pieces, lo = (unit - row * pieces) * piece_len;
    return {row, lo, min(vectors, lo + piece_len)};
  }
};

// The lanes of this warp below this one.
__device__ inline unsigned LanesBelow() {
  unsigned mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// The largest j < n with starts[j] <= x, for ascending starts with starts[0] <= x: the block holding x when
// blocks j start at starts[j] (empty blocks share their successor's start).
__device__ inline int32_t BlockAt(const int32_t* starts, int32_t n, int32_t x) {
  int32_t low = 0, high = n - 1;
  while (low < high) {
    const int32_t mid = (low + high + 1) / 2;
    if (starts[mid] <= x) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

// Calls visit(pair, live, key, same) for the pairs of segment [begin, end), 32 at a time, where same is the
// mask of the lanes with the same key. Lanes past the end are not live and get keys that match nobody. Each
// chunk's ids are loaded while the chunk before it is visited, so a segment's loads do not wait in turn.
template <typename Visit>
__device__ void WalkSegment(const int32_t* __restrict__ ids, int32_t num_experts, int32_t begin, int32_t end,
                            Visit visit) {
  const int lane = threadIdx.x % 32;
  auto load = [&](int32_t pair) { return pair < end ? ids[pair] : 0; };
  int32_t next = load(begin + lane);
  for (int32_t base = begin; base < end; base += 32) {
    const int32_t pair = base + lane, id = next;
    next = load(pair + 32);
    const bool live = pair < end;
    const int32_t key = live ? RoutingKey(id, num_experts) : num_experts + 1 + lane;
    visit(pair, live, key, __match_any_sync(0xffffffffu, key));
  }
}

// Exclusive prefix sums of value(0), ..., value(n - 1) over a block of kBlockThreads threads: each thread takes
// a contiguous run and calls emit(i, sum before i, value(i)) along it. value(i) is read twice; emit(i, ...) may
// overwrite what value(i) reads. Returns the total to every thread.
template <int kBlockThreads, typename Value, typename Emit>
__device__ int32_t ScanBlock(int32_t n, Value value, Emit emit,
                             typename cub::BlockScan<int32_t, kBlockThreads>::TempStorage& storage) {
  const int32_t per_thread = (n + kBlockThreads - 1) / kBlockThreads;
  const int32_t begin = min(n, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(n, begin + per_thread);
  int32_t sum = 0;
  for (int32_t i = begin; i < end; ++i) sum += value(i);
  int32_t running = 0, total = 0;
  cub::BlockScan<int32_t, kBlockThreads>(storage).ExclusiveSum(sum, running, total);
  for (int32_t i = begin; i < end; ++i) {
    const int32_t v = value(i);
    emit(i, running, v);
    running += v;
  }
  __syncthreads();  // emit's writes are visible, and the storage may be used again
  return total;
}

// Waits until every (member, block) arrival flag of this call holds `epoch`, the block's threads sharing the
// N * gridDim.x flags, then meets at a barrier. A wait that gave up leaves stale rows, never a hang.
template <int kBlockThreads>
__device__ __forceinline__ void WaitForEveryBlock(Patience<>& patience, const SymmetricControl* control, int size,
                                                  uint64_t epoch) {
  const int grid = static_cast<int>(gridDim.x);
  bool came = true;
  for (int flag = threadIdx.x; came && flag < size * grid; flag += kBlockThreads) {
    const int member = flag / grid;
    came = patience.AtLeast(&control->arrived[member][flag % grid], epoch, member);
  }
  __syncthreads_or(!came);
}

// Launches kernel<<<blocks, threads, shared>>>(call). A kernel whose dynamic shared memory, with its
// `static_bytes`, passes the 48 KiB every kernel gets must opt in first: always to `most`, the most any call
// takes, so that calls of other sizes (on other streams, or replayed from graphs) never lower the limit.
template <typename Call>
cudaError_t LaunchOptingIn(void (*kernel)(Call), int blocks, int threads, size_t shared, size_t static_bytes,
                           size_t most, cudaStream_t stream, const Call& call) {
  constexpr size_t kDefaultSharedBytes = 48 * 1024;
  if (shared + static_bytes > kDefaultSharedBytes) {
    const cudaError_t opted = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(most));
    if (opted != cudaSuccess) return opted;
  }
  kernel<<<blocks, threads, shared, stream>>>(call);
  return cudaGetLastError();
}

// Where the slots at `base` of `owner`'s symmetric memory start for calls of `parity`.
__device__ __forceinline__ uint8_t* Slots(const PeerTable* table, int64_t base, int owner, int parity) {
  return table->data[owner] + parity * table->parity_half_bytes + base;
}

// One 16-byte vector of T as float32 and back, and added in float32 times a weight (acc += w * v).
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static constexpr int kCount = 4;
  __device__ static void ToFloat(uint4 v, float (&f)[kCount]) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static void Add(float (&acc)[kCount], uint4 v, float w) {
    acc[0] += w * __uint_as_float(v.x);
    acc[1] += w * __uint_as_float(v.y);
    acc[2] += w * __uint_as_float(v.z);
    acc[3] += w * __uint_as_float(v.w);
  }
  __device__ static uint4 FromFloat(const float (&f)[kCount]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

template <typename T2, float2 (*ToFloat2)(T2), T2 (*FromFloat2)(float2)>
struct HalfLanes {
  static constexpr int kCount = 8;
  __device__ static void ToFloat(uint4 v, float (&f)[kCount]) {
    const T2* pairs = reinterpret_cast<const T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 two = ToFloat2(pairs[i]);
      f[2 * i] = two.x;
      f[2 * i + 1] = two.y;
    }
  }
  __device__ static void Add(float (&acc)[kCount], uint4 v, float w) {
    const T2* pairs = reinterpret_cast<const T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = ToFloat2(pairs[i]);
      acc[2 * i] += w * f.x;
      acc[2 * i + 1] += w * f.y;
    }
  }
  __device__ static uint4 FromFloat(const float (&f)[kCount]) {
    uint4 v;
    T2* pairs = reinterpret_cast<T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = FromFloat2(make_float2(f[2 * i], f[2 * i + 1]));
    return v;
  }
};

__device__ inline float2 Bf16ToFloat2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ inline __nv_bfloat162 Float2ToBf16(float2 v) { return __float22bfloat162_rn(v); }
__device__ inline float2 F16ToFloat2(__half2 v) { return __half22float2(v); }
__device__ inline __half2 Float2ToF16(float2 v) { return __float22half2_rn(v); }

template <>
struct Lanes<__nv_bfloat16> : HalfLanes<__nv_bfloat162, Bf16ToFloat2, Float2ToBf16> {};
template <>
struct Lanes<__half> : HalfLanes<__half2, F16ToFloat2, Float2ToF16> {};

}  // namespace jax_ncclx
