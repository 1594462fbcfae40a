// CPU handlers of take_rows (one memcpy per row part) and expand_rows (the CUDA kernel's walk, decoding rows on
// the 8-bit wire as XLA converts them).
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuExpandRows, ExpandRowsImpl, BindExpandRows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuTakeRows, TakeRowsImpl, BindTakeRows(ffi::Ffi::Bind()));

}  // namespace jax_ncclx
