// LL128 lines: data that carries its own arrival flag, so that a receiver polls the data itself instead of
// waiting for a separate flag that the sender raises after a release. A line is 128 bytes, stored by 8 lanes
// of one warp at once as 16-byte parts (Pair64): 120 payload bytes, then an 8-byte flag in the last lane's
// upper half. It relies on NVLink delivering a warp's aligned 128-byte store whole, as NCCL's LL128 does.
// A warp moves 4 lines a step: lane / 8 picks the line, lane % 8 the part.
#pragma once

#include <cuda_runtime.h>

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

// Warp steps of lines that a row of `bytes` of payload takes, where rows start on whole steps (no step spans
// two rows), and a step's bytes.
__host__ __device__ constexpr int64_t LineStepsOf(int64_t bytes) {
  return (LinesOf(bytes) + kLinesPerWarpStep - 1) / kLinesPerWarpStep;
}
constexpr int64_t kLineStepBytes = kLinesPerWarpStep * kLineBytes;
constexpr int kStepParts = kLinesPerWarpStep * kLanesPerLine;                    // 16-byte parts of a step
constexpr int64_t kStepVectors = kLinesPerWarpStep * kLinePayloadWords / 4;  // a step's payload in 16-byte vectors

// Word j (0..3) of a lane's part of a line.
__device__ __forceinline__ uint32_t WordOf(const Pair64& part, int j) {
  const uint64_t half = j < 2 ? part.lo : part.hi;
  return static_cast<uint32_t>(j % 2 == 0 ? half : half >> 32);
}

// A line's flag for call `epoch` in slots that other ops' data may have filled (the MoE kernels' slots lie past
// the collectives' LL areas): the epoch scrambled, top bit set, so that no plausible payload equals it.
__device__ __forceinline__ uint64_t ScrambledLineFlag(uint64_t epoch) {
  return epoch * 0x9E3779B97F4A7C15ull | uint64_t{1} << 63;
}

// A 16-byte {a, b} entry that one lane stores alone: each 8-byte half carries the upper 32 bits of the flag
// (they repeat only for calls billions apart), since a lone lane's store is seen whole only 8 bytes at a time.
__device__ __forceinline__ uint32_t EntryFlag(uint64_t flag) { return static_cast<uint32_t>(flag >> 32); }
__device__ __forceinline__ Pair64 EntryOf(uint32_t a, uint32_t b, uint64_t flag) {
  const uint64_t tag = static_cast<uint64_t>(EntryFlag(flag)) << 32;
  return Pair64{a | tag, b | tag};
}
__device__ __forceinline__ bool EntryHolds(Pair64 entry, uint64_t flag) {
  return static_cast<uint32_t>(entry.lo >> 32) == EntryFlag(flag) &&
         static_cast<uint32_t>(entry.hi >> 32) == EntryFlag(flag);
}

// Where a lane's part of a line holds payload: its first word in the row (a multiple of 2) and how many words
// it carries (4, or 2 on the flag lane), counted past the row's `words` as none.
struct LinePart {
  int64_t first;
  int count;
  __device__ LinePart(int64_t line, int part, int64_t words) : first(line * kLinePayloadWords + part * 4) {
    const int64_t most = part == kLanesPerLine - 1 ? 2 : 4;
    count = static_cast<int>(max(int64_t{0}, min(most, words - first)));
  }
};

// This lane's part of warp step `step` of a row of `words` payload words (lane / 8 picks the line, lane % 8 the
// part).
__device__ __forceinline__ LinePart StepPart(int64_t step, int64_t words) {
  const int lane = threadIdx.x % 32;
  return LinePart(step * kLinesPerWarpStep + lane / kLanesPerLine, lane % kLanesPerLine, words);
}

// The part's payload words as a 16-byte vector (zeros where it carries none, the flag's place included), and
// back, with the flag in the flag lane's upper half.
__device__ __forceinline__ uint4 PayloadOf(Pair64 part, int count) {
  return make_uint4(count > 0 ? static_cast<uint32_t>(part.lo) : 0u,
                    count > 0 ? static_cast<uint32_t>(part.lo >> 32) : 0u,
                    count > 2 ? static_cast<uint32_t>(part.hi) : 0u,
                    count > 2 ? static_cast<uint32_t>(part.hi >> 32) : 0u);
}
__device__ __forceinline__ Pair64 PartOf(uint4 payload, bool flag_lane, uint64_t flag) {
  return Pair64{payload.x | static_cast<uint64_t>(payload.y) << 32,
                flag_lane ? flag : payload.z | static_cast<uint64_t>(payload.w) << 32};
}

// A part's payload words of a row in global memory (8-byte aligned: `first` is even), as a vector with zeros
// past `count`, and back.
__device__ __forceinline__ uint4 LoadPayload(const uint32_t* row, LinePart at) {
  const uint2* from = reinterpret_cast<const uint2*>(row + at.first);
  const uint2 lo = at.count > 0 ? from[0] : make_uint2(0, 0);
  const uint2 hi = at.count > 2 ? from[1] : make_uint2(0, 0);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void StorePayload(uint32_t* row, LinePart at, uint4 payload) {
  uint2* to = reinterpret_cast<uint2*>(row + at.first);
  if (at.count > 0) to[0] = make_uint2(payload.x, payload.y);
  if (at.count > 2) to[1] = make_uint2(payload.z, payload.w);
}

// Takes the lines of warp steps [lo, hi) of a row whose parts start at `row` (a step is 4 lines, 32 parts:
// lane l reads part l of each), kBatch steps at a time: loads them all, polls until every line of the batch
// carries `flag`, asking keep_waiting(spins) (the same on every lane) after each failed poll, then calls
// take(step, part) for each. kBatch steps of loads are in flight at once, not one step's.
template <int kBatch, typename KeepWaiting, typename Take>
__device__ __forceinline__ void WarpTakeLines(const Pair64* row, int64_t lo, int64_t hi, uint64_t flag,
                                              KeepWaiting keep_waiting, Take take) {
  const int lane = threadIdx.x % 32;
  const bool flag_lane = lane % kLanesPerLine == kLanesPerLine - 1;
  for (int64_t first = lo; first < hi; first += kBatch) {
    Pair64 got[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (first + b < hi) got[b] = LoadVolatile(row + (first + b) * kStepParts + lane);
    }
    for (uint32_t spins = 1;; ++spins) {
      bool torn = false;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) torn |= first + b < hi && flag_lane && got[b].hi != flag;
      if (!__any_sync(0xffffffffu, torn) || !keep_waiting(spins)) break;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (first + b < hi) got[b] = LoadVolatile(row + (first + b) * kStepParts + lane);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (first + b < hi) take(first + b, got[b]);
    }
  }
}

// Copies warp steps [lo, hi) of a row sent as lines (its parts at `from`) into the row of `words` payload
// words at `to`, kBatch steps at a time, as WarpTakeLines polls them.
template <int kBatch, typename KeepWaiting>
__device__ __forceinline__ void WarpTakeLineRow(const Pair64* from, uint32_t* to, int64_t words, int64_t lo, int64_t hi,
                                                uint64_t flag, KeepWaiting keep_waiting) {
  WarpTakeLines<kBatch>(from, lo, hi, flag, keep_waiting, [&](int64_t step, Pair64 got) {
    const LinePart at = StepPart(step, words);
    StorePayload(to, at, PayloadOf(got, at.count));
  });
}

}  // namespace jax_ncclx
