// Rows on moe.dispatch's 8-bit wire, on the device: H values of an 8-bit float format, then a float32 scale per
// kMoeWireBlock values (contract.h; moe_dispatch.py's _encode and _decode are the same arithmetic in XLA). The
// dispatch kernel quantizes and dequantizes them; encode_rows quantizes them, expand_rows dequantizes them as it
// expands.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/contract.h"
#include "common/warp_copy.cuh"

namespace jax_ncclx {

// How rows travel: as they are (Plain), or as 8-bit floats of kFormat with a float32 scale per kMoeWireBlock
// values, converted from and back to Token (float, __nv_bfloat16 or __half).
struct Plain {};
template <typename Token, __nv_fp8_interpretation_t kFormat>
struct Wire {
  static constexpr float kLargest = MoeWireLargest(kFormat == __NV_E4M3 ? MoeWire::kE4M3 : MoeWire::kE5M2);
  static constexpr float kInverse = 1.0f / kLargest;
};
template <typename Rows>
constexpr bool kOnWire = !std::is_same_v<Rows, Plain>;
template <typename Rows>
struct WireOf;
template <typename T, __nv_fp8_interpretation_t F>
struct WireOf<Wire<T, F>> {
  using Token = T;
  static constexpr __nv_fp8_interpretation_t kFormat = F;
};

// launch(Rows{}) for the Rows of a call's wire and tokens' dtype: Plain without an 8-bit wire, else
// Wire<token type, format>. cudaErrorInvalidValue for a wire or dtype that names none.
template <typename Launch>
cudaError_t WithRows(MoeWire wire, FloatType token_type, Launch launch) {
  auto on_wire = [&](auto format) -> cudaError_t {
    constexpr __nv_fp8_interpretation_t kFormat = decltype(format)::value;
    switch (token_type) {
      case FloatType::kF32:
        return launch(Wire<float, kFormat>{});
      case FloatType::kBF16:
        return launch(Wire<__nv_bfloat16, kFormat>{});
      case FloatType::kF16:
        return launch(Wire<__half, kFormat>{});
    }
    return cudaErrorInvalidValue;
  };
  switch (wire) {
    case MoeWire::kNone:
      return launch(Plain{});
    case MoeWire::kE4M3:
      return on_wire(std::integral_constant<__nv_fp8_interpretation_t, __NV_E4M3>{});
    case MoeWire::kE5M2:
      return on_wire(std::integral_constant<__nv_fp8_interpretation_t, __NV_E5M2>{});
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
template <typename Token>
__device__ __forceinline__ Token FromFloat(float v) {
  if constexpr (std::is_same_v<Token, float>) {
    return v;
  } else if constexpr (std::is_same_v<Token, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// Two 8-bit values (the low byte first) times scale.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ float2 DecodePair(uint32_t bits, float scale) {
  const float2 pair = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), kFormat)));
  return make_float2(pair.x * scale, pair.y * scale);
}

// Vector v (16 bytes of Token) of a token row, dequantized from the wire row `row` (written by peers).
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint4 DequantizeVector(const uint8_t* row, int64_t v, int64_t hidden) {
  constexpr int kValues = 16 / sizeof(Token);
  const int64_t first = v * kValues;
  const float scale = __ldcg(reinterpret_cast<const float*>(row + hidden) + first / kMoeWireBlock);
  uint32_t bits[kValues / 4];
  if constexpr (kValues == 8) {
    const uint2 eight = __ldcg(reinterpret_cast<const uint2*>(row + first));
    bits[0] = eight.x, bits[1] = eight.y;
  } else {
    bits[0] = __ldcg(reinterpret_cast<const unsigned int*>(row + first));
  }
  uint4 out;
  Token* values = reinterpret_cast<Token*>(&out);
#pragma unroll
  for (int i = 0; i < kValues / 2; ++i) {
    const float2 pair = DecodePair<kFormat>(bits[i / 2] >> (16 * (i % 2)), scale);
    values[2 * i] = FromFloat<Token>(pair.x);
    values[2 * i + 1] = FromFloat<Token>(pair.y);
  }
  return out;
}

// Lane `lane`'s 4 values of block b (values [b * kMoeWireBlock, (b + 1) * kMoeWireBlock)) of the token row `in`,
// as float: one 16-byte (float) or 8-byte load.
template <typename Token>
__device__ __forceinline__ void LoadBlockValues(const Token* in, int32_t b, int lane, float (&v)[4]) {
  static_assert(kMoeWireBlock == 4 * 32, "a lane's 4 values");
  const Token* values = in + int64_t{b} * kMoeWireBlock + lane * 4;
  if constexpr (sizeof(Token) == 4) {
    const float4 four = *reinterpret_cast<const float4*>(values);
    v[0] = four.x, v[1] = four.y, v[2] = four.z, v[3] = four.w;
  } else {
    const uint2 bits = *reinterpret_cast<const uint2*>(values);
    const Token* four = reinterpret_cast<const Token*>(&bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = ToFloat(four[i]);
  }
}

// One block of a token row quantized by the 32 lanes of a warp, each holding its 4 values v (LoadBlockValues):
// the lane's 4 8-bit values (the first in the low byte), and in `scale` the block's scale (the same on every
// lane).
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t QuantizeBlock(const float (&v)[4], float& scale) {
  // A NaN anywhere makes the block's scale NaN, as jnp.max does in the chain (fmaxf would drop it).
  auto max_nan = [](float a, float b) {
    float m;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
  };
  float largest = max_nan(max_nan(fabsf(v[0]), fabsf(v[1])), max_nan(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int d = 16; d > 0; d /= 2) largest = max_nan(largest, __shfl_xor_sync(0xffffffffu, largest, d));
  // The chain's arithmetic (_encode): scale = max |v| * (1 / largest), q = v / scale (v / 1 for a zero block),
  // divided as XLA's GPU backend divides (div.full.f32, not div.rn), so that both round q alike.
  scale = largest * Wire<Token, kFormat>::kInverse;
  const float divisor = scale > 0.0f ? scale : 1.0f;
  auto q = [divisor](float x) {
    float quotient;
    asm("div.full.f32 %0, %1, %2;" : "=f"(quotient) : "f"(x), "f"(divisor));
    return quotient;
  };
  const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(q(v[0]), q(v[1])), __NV_SATFINITE, kFormat);
  const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(q(v[2]), q(v[3])), __NV_SATFINITE, kFormat);
  return low | high << 16;
}

// Quantizes block b of a token row, whose lane's values are v (LoadBlockValues), into the wire row `row` (H
// values, then the float32 scales) with the 32 lanes of a warp: the block's values, and lane 0 its scale.
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void StoreQuantizedBlock(uint8_t* row, const float (&v)[4], int32_t b, int64_t hidden,
                                                    int lane) {
  float scale;
  const uint32_t word = QuantizeBlock<Token, kFormat>(v, scale);
  reinterpret_cast<uint32_t*>(row + int64_t{b} * kMoeWireBlock)[lane] = word;
  if (lane == 0) reinterpret_cast<float*>(row + hidden)[b] = scale;
}

// A lane's 4 values of block b, four 8-bit values of `word` (the first in the low byte) times scale, stored into
// the token row `out` where LoadBlockValues reads them: one 16-byte (float) or 8-byte store.
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void StoreDecodedWord(Token* out, uint32_t word, float scale, int32_t b, int lane) {
  const float2 low = DecodePair<kFormat>(word, scale), high = DecodePair<kFormat>(word >> 16, scale);
  Token* values = out + int64_t{b} * kMoeWireBlock + lane * 4;
  if constexpr (sizeof(Token) == 4) {
    *reinterpret_cast<float4*>(values) = make_float4(low.x, low.y, high.x, high.y);
  } else {
    uint2 bits;
    Token* four = reinterpret_cast<Token*>(&bits);
    four[0] = FromFloat<Token>(low.x), four[1] = FromFloat<Token>(low.y);
    four[2] = FromFloat<Token>(high.x), four[3] = FromFloat<Token>(high.y);
    *reinterpret_cast<uint2*>(values) = bits;
  }
}

// Blocks a warp quantizes at once (QuantizeBlocks): their loads go out together, where one block at a time would
// wait out a memory round trip per kMoeWireBlock values.
constexpr int32_t kQuantizeBlocks = 4;

// Blocks [first, first + kQuantizeBlocks) of the token row `in` (those below blocks = H / kMoeWireBlock)
// quantized into the wire row `row` with the 32 lanes of a warp, every block's loads before the first reduction.
template <typename Token, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void QuantizeBlocks(uint8_t* row, const Token* in, int32_t first, int32_t blocks,
                                               int64_t hidden, int lane) {
  float v[kQuantizeBlocks][4];
#pragma unroll
  for (int k = 0; k < kQuantizeBlocks; ++k) {
    if (first + k < blocks) LoadBlockValues(in, first + k, lane, v[k]);
  }
#pragma unroll
  for (int k = 0; k < kQuantizeBlocks; ++k) {
    if (first + k < blocks) StoreQuantizedBlock<Token, kFormat>(row, v[k], first + k, hidden, lane);
  }
}

// Vectors [lo, hi) of the token row `to`, taken from the wire row `from` (written by peers during the kernel)
// with the 32 lanes of a warp: copied as they are (Plain) or dequantized, four vectors in flight per lane as in
// WarpCopy. row_bytes: a token row's bytes.
template <typename Rows>
__device__ __forceinline__ void WarpTakeWireRow(uint4* to, const uint8_t* from, int64_t lo, int64_t hi,
                                                int64_t row_bytes) {
  if constexpr (kOnWire<Rows>) {
    using Token = typename WireOf<Rows>::Token;
    const int64_t hidden = row_bytes / static_cast<int64_t>(sizeof(Token));
    constexpr int kBatch = 4;
    for (int64_t v = lo + threadIdx.x % 32; v < hi; v += 32 * kBatch) {
      uint4 out[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (v + 32 * u < hi) out[u] = DequantizeVector<Token, WireOf<Rows>::kFormat>(from, v + 32 * u, hidden);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (v + 32 * u < hi) to[v + 32 * u] = out[u];
      }
    }
  } else {
    WarpCopy<uint4, true>(to + lo, reinterpret_cast<const uint4*>(from) + lo, hi - lo);
  }
}

}  // namespace jax_ncclx
