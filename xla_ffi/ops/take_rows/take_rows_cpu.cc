// CPU handlers of take_rows (one memcpy per row part), expand_rows (the CUDA kernel's walk, decoding rows on
// the 8-bit wire as XLA converts them) and encode_rows (moe_dispatch._encode's arithmetic, as XLA's CPU backend
// runs it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "ops/take_rows/take_rows.h"
#include "ops/take_rows/take_rows_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

ffi::Error TakeRowsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, std::optional<ffi::AnyBuffer> suffix,
                        ffi::Result<ffi::AnyBuffer> out) {
  ffi::ErrorOr<TakeRowsShape> shape = GetTakeRowsShape(x, index, suffix, *out);
  if (shape.has_error()) return shape.error();
  const TakeRowsShape& s = *shape;
  const auto* rows = static_cast<const uint8_t*>(x.untyped_data());
  const auto* tails = static_cast<const uint8_t*>(OptionalData(suffix));
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.rows; ++i, dst += s.out_row_bytes()) {
      const int64_t row = index.typed_data()[b * s.rows + i];
      if (row >= 0 && row < s.source_rows) {
        std::memcpy(dst, rows + (b * s.source_rows + row) * s.x_row_bytes, s.take_bytes);
      } else {
        std::memset(dst, 0, s.take_bytes);
      }
      if (tails != nullptr) std::memcpy(dst + s.take_bytes, tails + (b * s.rows + i) * s.suffix_bytes, s.suffix_bytes);
    }
  }
  return ffi::Error::Success();
}

// One value of an 8-bit float: e4m3fn (no infinities, S.1111.111 is NaN) or e5m2 (IEEE-like).
float DecodeWireValue(uint8_t bits, MoeWire wire) {
  const float sign = bits & 0x80 ? -1.0f : 1.0f;
  if (wire == MoeWire::kE4M3) {
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
    if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
    return sign * (exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                 : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7));
  }
  const int exponent = (bits >> 2) & 0x1f, mantissa = bits & 0x3;
  if (exponent == 0x1f)
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  return sign * (exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -16)
                               : std::ldexp(1.0f + mantissa / 4.0f, exponent - 15));
}

// v rounded to the nearest even bfloat16 / float16 (as XLA converts), as bits.
uint16_t ToBfloat16(float v) {
  uint32_t x;
  std::memcpy(&x, &v, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // a quiet NaN
  x += 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}
uint16_t ToFloat16(float v) {
  uint32_t x;
  std::memcpy(&x, &v, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up round to infinity
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal, in units of 2^-24 (the scaling is exact)
    float below;
    std::memcpy(&below, &magnitude, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(below * 16777216.0f)));
  }
  uint32_t half = (magnitude >> 13) - ((127 - 15) << 10);  // rebiased exponent and the top 10 mantissa bits
  const uint32_t rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) ++half;
  return static_cast<uint16_t>(sign | half);
}

// bfloat16 / float16 bits as float (exact).
float FromBfloat16(uint16_t bits) {
  const uint32_t x = uint32_t{bits} << 16;
  float v;
  std::memcpy(&v, &x, 4);
  return v;
}
float FromFloat16(uint16_t bits) {
  const float sign = bits & 0x8000u ? -1.0f : 1.0f;
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent == 0x1f)
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  return sign * (exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                               : std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15));
}

// Row `wire_row` (H values on the wire, then H / kMoeWireBlock float32 scales) decoded into `out` (H tokens).
void DecodeWireRow(const uint8_t* wire_row, int64_t hidden, MoeWire wire, FloatType token, uint8_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float scale;
    std::memcpy(&scale, wire_row + hidden + 4 * (i / kMoeWireBlock), 4);
    const float value = DecodeWireValue(wire_row[i], wire) * scale;
    if (token == FloatType::kF32) {
      std::memcpy(out + 4 * i, &value, 4);
    } else {
      const uint16_t bits = token == FloatType::kBF16 ? ToBfloat16(value) : ToFloat16(value);
      std::memcpy(out + 2 * i, &bits, 2);
    }
  }
}

// v rounded to the nearest (ties to even) value of the 8-bit float `wire`, as XLA's CPU backend converts:
// e4m3fn has no infinities, so past its largest finite value (448) comes NaN; e5m2 goes to infinity there.
uint8_t EncodeWireValue(float v, MoeWire wire) {
  const bool e4m3 = wire == MoeWire::kE4M3;
  const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint32_t nan = e4m3 ? 0x7fu : 0x7eu, infinity = e4m3 ? 0x7fu : 0x7cu;
  uint32_t x;
  std::memcpy(&x, &v, 4);
  const uint32_t sign = (x >> 24) & 0x80u, magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | nan);
  float below;
  std::memcpy(&below, &magnitude, 4);
  if (below < std::ldexp(1.0f, 1 - bias)) {  // a subnormal of the wire (or zero), in units of its smallest
    return static_cast<uint8_t>(sign |
                                static_cast<uint32_t>(std::nearbyint(std::ldexp(below, bias - 1 + mantissa_bits))));
  }
  const int drop = 23 - mantissa_bits;  // float32 mantissa bits that do not fit
  uint32_t bits = (magnitude >> drop) - ((127u - bias) << mantissa_bits);
  const uint32_t rest = magnitude & ((1u << drop) - 1), half = 1u << (drop - 1);
  if (rest > half || (rest == half && (bits & 1))) ++bits;
  return static_cast<uint8_t>(sign | std::min(bits, infinity));
}

// encode_rows on the CPU: each block's scale (its largest magnitude, NaN if any value is, times 1 / the wire's
// largest value) and its values divided by the scale (by 1 for a scale of 0 or NaN), as _encode. A block with a
// NaN gets scale NaN; its values are not meaningful (XLA's CPU backend divides them by a max that may skip it).
ffi::Error EncodeRowsImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, MoeWire wire) {
  ffi::ErrorOr<EncodeRowsCall> call = GetEncodeRowsCall(x, *out, wire);
  if (call.has_error()) return call.error();
  const int64_t hidden = call->hidden, blocks = hidden / kMoeWireBlock;
  const int token_bytes = FloatTypeBytes(call->token);
  const float inverse = static_cast<float>(1.0 / MoeWireLargest(wire));
  const auto* tokens = static_cast<const uint8_t*>(x.untyped_data());
  auto* rows = static_cast<uint8_t*>(out->untyped_data());
  std::vector<float> values(hidden);
  for (int64_t r = 0; r < call->rows; ++r) {
    const uint8_t* in = tokens + r * hidden * token_bytes;
    for (int64_t i = 0; i < hidden; ++i) {
      if (call->token == FloatType::kF32) {
        std::memcpy(&values[i], in + 4 * i, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, in + 2 * i, 2);
        values[i] = call->token == FloatType::kBF16 ? FromBfloat16(bits) : FromFloat16(bits);
      }
    }
    uint8_t* row = rows + r * (hidden + 4 * blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      float largest = 0.0f;
      for (int64_t i = b * kMoeWireBlock; i < (b + 1) * kMoeWireBlock; ++i) {
        const float magnitude = std::fabs(values[i]);
        if (std::isnan(magnitude) || std::isnan(largest)) {
          largest = std::numeric_limits<float>::quiet_NaN();
        } else {
          largest = std::max(largest, magnitude);
        }
      }
      const float scale = largest * inverse;
      // Times the divisor's float32 reciprocal: XLA's CPU backend divides by a broadcast value so.
      const float reciprocal = 1.0f / (scale > 0.0f ? scale : 1.0f);
      for (int64_t i = b * kMoeWireBlock; i < (b + 1) * kMoeWireBlock; ++i) {
        row[i] = EncodeWireValue(values[i] * reciprocal, wire);
      }
      std::memcpy(row + hidden + 4 * b, &scale, 4);
    }
  }
  return ffi::Error::Success();
}

// The CUDA kernel's walk: zeros where the index is out of range, then each row of x to the rows sources lists
// (decoded from the 8-bit wire first, where x's rows are on it).
ffi::Error ExpandRowsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> sources,
                          ffi::Result<ffi::AnyBuffer> out, MoeWire wire) {
  ffi::ErrorOr<ExpandRowsCall> call = GetExpandRowsCall(x, index, sources, *out, wire);
  if (call.has_error()) return call.error();
  const TakeRowsShape& s = call->shape;
  const int32_t top_k = call->top_k;
  const auto* rows = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t o = 0; o < s.batch * s.rows; ++o) {
    const int64_t row = index.typed_data()[o];
    if (row < 0 || row >= s.source_rows) std::memset(dst + o * s.take_bytes, 0, s.take_bytes);
  }
  const int64_t hidden = s.take_bytes / FloatTypeBytes(call->token);
  std::vector<uint8_t> decoded(wire == MoeWire::kNone ? 0 : s.take_bytes);
  for (int64_t r = 0; r < s.batch * s.source_rows; ++r) {
    const int64_t b = r / s.source_rows;
    const uint8_t* from = rows + r * s.x_row_bytes;
    bool read = false;
    for (int32_t j = 0; j < top_k; ++j) {
      const int64_t to = sources.typed_data()[r * top_k + j];
      if (to < 0 || to >= s.rows) continue;
      if (wire != MoeWire::kNone && !read) {  // once per row, as the kernel reads it
        DecodeWireRow(from, hidden, wire, call->token, decoded.data());
        read = true;
      }
      std::memcpy(dst + (b * s.rows + to) * s.take_bytes, wire == MoeWire::kNone ? from : decoded.data(), s.take_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuEncodeRows, EncodeRowsImpl, BindEncodeRows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuExpandRows, ExpandRowsImpl, BindExpandRows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuTakeRows, TakeRowsImpl, BindTakeRows(ffi::Ffi::Bind()));

}  // namespace jax_ncclx
