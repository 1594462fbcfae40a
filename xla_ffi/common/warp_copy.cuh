// Row copies by one warp: the inner loop of the NVLink kernels (all_to_allv_dynamic's and moe.dispatch's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ncclx {

// Data other GPUs write during this kernel: read past L1 (ld.global.cg), which would keep a stale line.
template <typename V>
__device__ __forceinline__ V LoadStaged(const V* p) {
  return __ldcg(p);
}

// Copies n units (none when n <= 0) with the 32 lanes of a warp, four loads in flight per lane before their
// stores: a loop of load-then-store waits out a memory round trip per unit. `kFromPeers`: src is written by
// other GPUs during the kernel (LoadStaged).
template <typename V, bool kFromPeers>
__device__ __forceinline__ void WarpCopy(V* dst, const V* src, int64_t n) {
  constexpr int kUnroll = 4;
  int64_t u = threadIdx.x % 32;
  for (; u + (kUnroll - 1) * 32 < n; u += kUnroll * 32) {
    V v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = kFromPeers ? LoadStaged(src + u + k * 32) : src[u + k * 32];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[u + k * 32] = v[k];
  }
  for (; u < n; u += 32) dst[u] = kFromPeers ? LoadStaged(src + u) : src[u];
}

// Writes n zero units with the 32 lanes of a warp.
template <typename V>
__device__ __forceinline__ void WarpZero(V* dst, int64_t n) {
  for (int64_t u = threadIdx.x % 32; u < n; u += 32) dst[u] = V{};
}

}  // namespace jax_ncclx
