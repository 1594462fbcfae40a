// moe.dispatch's 8-bit wire as LL128 lines, so that it polls its data as plain rows do (ll128_lines.cuh)
// instead of waiting for every block's flag. A warp step (4 lines, 32 16-byte parts, 480 payload bytes) carries
// kWireStepBlocks whole blocks of kMoeWireBlock values and their scales, quantized as the step is sent:
//   words 0..2 of lane l's part: its 4 values (LoadBlockValues' lane * 4) of the step's blocks 0..2;
//   word 3 of lanes 0..2: the scales of blocks 0..2; word 3 of lane 8j + 6: block 2's word of lane 8j + 7,
//   the line's flag lane, whose words 2 and 3 are the flag.
// So no value moves between lanes but the flag lanes' one word, and a step is whole in itself: any warp can
// send or take any step. A row of H values takes ceil(H / 384) steps (7168 values: 19 steps, 9728 bytes, 0.63
// of a bf16 row's lines). The arithmetic is the flags path's: the same QuantizeBlock, and
// DecodePair as in DequantizeVector.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/contract.h"
#include "common/ll128_lines.cuh"
#include "common/wire_rows.cuh"

namespace jax_ncclx {

constexpr int kWireStepBlocks = 3;
static_assert(kMoeWireBlock == 4 * 32 && kWireStepBlocks < kLanesPerLine - 1, "a lane's 4 values; lanes 0..2");

// Blocks of an 8-bit wire row of wire_row_bytes: kMoeWireBlock values and a float32 scale each
// (MoeDispatchWireRowBytes, H a multiple of kMoeWireBlock).
__host__ __device__ constexpr int64_t WireBlocks(int64_t wire_row_bytes) {
  return wire_row_bytes / (kMoeWireBlock + 4);
}

// Whether a call's wire row is its token row's: the same bytes without a wire, else whole blocks of its values.
inline bool WireRowMatches(MoeWire wire, FloatType token_type, int64_t row_bytes, int64_t wire_row_bytes) {
  if (wire == MoeWire::kNone) return wire_row_bytes == row_bytes;
  const int64_t blocks = WireBlocks(wire_row_bytes);
  return wire_row_bytes == blocks * (kMoeWireBlock + 4) &&
         row_bytes == blocks * kMoeWireBlock * FloatTypeBytes(token_type);
}

// Warp steps of lines that a slot row takes: a plain row's bytes, or an 8-bit wire row's blocks.
__host__ __device__ constexpr int64_t RowLineSteps(MoeWire wire, int64_t wire_row_bytes) {
  if (wire == MoeWire::kNone) return LineStepsOf(wire_row_bytes);
  return (WireBlocks(wire_row_bytes) + kWireStepBlocks - 1) / kWireStepBlocks;
}

// The first 16-byte vector of a token row (of row_vectors) that warp step `step` holds: steps [lo, hi) hold
// vectors [StepVector(lo), StepVector(hi)).
template <typename Rows>
__device__ __forceinline__ int64_t StepVector(int64_t step, int64_t row_vectors) {
  int64_t per_step = kStepVectors;
  if constexpr (kOnWire<Rows>) per_step = kWireStepBlocks * kMoeWireBlock * sizeof(typename WireOf<Rows>::Token) / 16;
  return min(step * per_step, row_vectors);
}

// This lane's 16-byte payload of warp step `step` of the token row `row` (of `blocks` blocks) on the 8-bit wire,
// quantized by the 32 lanes of the warp (the layout above; zeros past the row).
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint4 QuantizedStep(const Token* row, int64_t step, int32_t blocks, int lane) {
  float v[kWireStepBlocks][4];
  uint32_t word[kWireStepBlocks];
  float scale[kWireStepBlocks];
  const int32_t first = static_cast<int32_t>(step) * kWireStepBlocks;
#pragma unroll
  for (int j = 0; j < kWireStepBlocks; ++j) {  // every block's loads before the first reduction
    if (first + j < blocks) LoadBlockValues(row, first + j, lane, v[j]);
  }
#pragma unroll
  for (int j = 0; j < kWireStepBlocks; ++j) {
    word[j] = 0u, scale[j] = 0.0f;
    if (first + j < blocks) word[j] = QuantizeBlock<Token, kFormat>(v[j], scale[j]);  // the same j on every lane
  }
  const uint32_t next_block2 = __shfl_down_sync(0xffffffffu, word[2], 1);
  uint32_t last = lane % kLanesPerLine == kLanesPerLine - 2 ? next_block2 : 0u;
  if (lane < kWireStepBlocks) last = __float_as_uint(lane == 0 ? scale[0] : lane == 1 ? scale[1] : scale[2]);
  return make_uint4(word[0], word[1], word[2], last);
}

// Dequantizes warp step `step` of a row on the 8-bit wire, whose part `got` this lane took (WarpTakeLines), into
// the token row `row` (of `blocks` blocks), with the 32 lanes of the warp.
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void DequantizeStep(Token* row, Pair64 got, int64_t step, int32_t blocks, int lane) {
  const uint32_t word3 = static_cast<uint32_t>(got.hi >> 32);
  const uint32_t before = __shfl_up_sync(0xffffffffu, word3, 1);  // a flag lane's block-2 word
  const uint32_t word[kWireStepBlocks] = {static_cast<uint32_t>(got.lo), static_cast<uint32_t>(got.lo >> 32),
                                          lane % kLanesPerLine == kLanesPerLine - 1 ? before
                                                                                    : static_cast<uint32_t>(got.hi)};
  const int32_t first = static_cast<int32_t>(step) * kWireStepBlocks;
#pragma unroll
  for (int j = 0; j < kWireStepBlocks; ++j) {
    const float scale = __uint_as_float(__shfl_sync(0xffffffffu, word3, j));
    if (first + j < blocks) StoreDecodedWord<Token, kFormat>(row, word[j], scale, first + j, lane);
  }
}

// Sends warp steps [lo, hi) of a row, kBatch at a time (loaded, or quantized, before any is stored), as lines
// with `flag` into the slot row whose parts start at `to`: a plain row's payload words from `row` (of `words`
// words), or on the 8-bit wire its `blocks` blocks quantized (QuantizedStep).
template <typename Rows, int kBatch>
__device__ __forceinline__ void WarpSendLineSteps(Pair64* to, const void* row, int64_t words, int32_t blocks,
                                                  int64_t lo, int64_t hi, uint64_t flag) {
  const int lane = threadIdx.x % 32;
  const bool flag_lane = lane % kLanesPerLine == kLanesPerLine - 1;
  for (int64_t batch = lo; batch < hi; batch += kBatch) {
    uint4 payload[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (batch + b >= hi) continue;
      if constexpr (kOnWire<Rows>) {
        payload[b] = QuantizedStep<typename WireOf<Rows>::Token, WireOf<Rows>::kFormat>(
            static_cast<const typename WireOf<Rows>::Token*>(row), batch + b, blocks, lane);
      } else {
        payload[b] = LoadPayload(static_cast<const uint32_t*>(row), StepPart(batch + b, words));
      }
    }
    __syncwarp();  // a line's 8 lanes store it in one instruction
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (batch + b < hi) StoreVolatile(to + lane + (batch + b) * kStepParts, PartOf(payload[b], flag_lane, flag));
    }
  }
}

// Takes warp steps [lo, hi) of a row sent as lines (its parts at `from`) into the token row `to`, kBatch at a
// time as WarpTakeLines polls them: a plain row's `words` payload words, or its `blocks` blocks dequantized from
// the 8-bit wire.
template <typename Rows, int kBatch, typename KeepWaiting>
__device__ __forceinline__ void WarpTakeLineSteps(const Pair64* from, void* to, int64_t words, int32_t blocks,
                                                  int64_t lo, int64_t hi, uint64_t flag, KeepWaiting keep_waiting) {
  if constexpr (kOnWire<Rows>) {
    using Token = typename WireOf<Rows>::Token;
    const int lane = threadIdx.x % 32;
    WarpTakeLines<kBatch>(from, lo, hi, flag, keep_waiting, [&](int64_t step, Pair64 got) {
      DequantizeStep<Token, WireOf<Rows>::kFormat>(static_cast<Token*>(to), got, step, blocks, lane);
    });
  } else {
    WarpTakeLineRow<kBatch>(from, static_cast<uint32_t*>(to), words, lo, hi, flag, keep_waiting);
  }
}

}  // namespace jax_ncclx
