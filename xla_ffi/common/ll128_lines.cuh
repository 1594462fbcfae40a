// LL128 lines: data that carries its own arrival flag, so that a receiver polls the data itself instead of
// waiting for a separate flag that the sender raises after a release. A line is 128 bytes, stored by 8 lanes
// of one warp at once as 16-byte parts (Pair64): 120 payload bytes, then an 8-byte flag in the last lane's
// upper half. It relies on NVLink delivering a warp's aligned 128-byte store whole, as NCCL's LL128 does.
// A warp moves 4 lines a step: lane / 8 picks the line, lane % 8 the part.
#pragma once

#include <cstdint>

#include "common/device_sync.cuh"

namespace jax_ncclx {

constexpr int kLineBytes = 128;
constexpr int kLinePayloadWords = 30;  // 4-byte words: 120 bytes
constexpr int kLanesPerLine = 8;
constexpr int kLinesPerWarpStep = 32 / kLanesPerLine;

// Lines that carry `bytes` of payload (a multiple of 4).
__host__ __device__ constexpr int64_t LinesOf(int64_t bytes) {
  return (bytes / 4 + kLinePayloadWords - 1) / kLinePayloadWords;
}

// Word j (0..3) of a lane's part of a line.
__device__ __forceinline__ uint32_t WordOf(const Pair64& part, int j) {
  const uint64_t half = j < 2 ? part.lo : part.hi;
  return static_cast<uint32_t>(j % 2 == 0 ? half : half >> 32);
}

}  // namespace jax_ncclx
