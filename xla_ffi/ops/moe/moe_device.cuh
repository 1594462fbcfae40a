// Device helpers the MoE kernels share (the routing kernels, and moe.dispatch's kernel, which does their work
// in one launch, and moe.combine's): fast division by a call's fixed divisors, how rows are shared out among
// warps, lane masks, block lookups and a walk over a segment of pairs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

// How the NVLink MoE kernels share rows out: warp-sized units of (row, piece of its vectors), as many pieces
// per row as it takes to give every warp of the grid work, so a few decode rows still spread over every SM
// while prefill rows go whole to a warp, which reads the row's indices once.
struct Units {
  int64_t pieces;     // per row
  int64_t piece_len;  // vectors per piece
  __device__ Units(int64_t rows, int64_t vectors, int64_t warps) {
    const int64_t most = max(int64_t{1}, (vectors + 31) / 32);  // a piece of at least one vector per lane
    pieces = rows == 0 ? 1 : min(most, max(int64_t{1}, (warps + rows - 1) / rows));
    piece_len = (vectors + pieces - 1) / pieces;
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

}  // namespace jax_ncclx
