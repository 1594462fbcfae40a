// Error helpers shared by every handler: failures become ffi::Error values that name the op, the argument
// and the problem. Handlers never abort the process.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "common/contract.h"
#include "common/contract_attrs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(std::string_view op, std::string_view message) {
  return ffi::Error::InvalidArgument("jax_ncclx " + std::string(op) + ": " + std::string(message));
}

inline ffi::Error Internal(std::string_view op, std::string_view message) {
  return ffi::Error::Internal("jax_ncclx " + std::string(op) + ": " + std::string(message));
}

// What sets a call's timeout, for the messages that report one.
inline constexpr std::string_view kTimeoutSettings = "JAX_NCCLX_TIMEOUT_S, or JAX_NCCLX_TIMEOUT_S_<OP> for one op";

inline ffi::Error DeadlineExceeded(std::string_view op, std::string_view message) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, "jax_ncclx " + std::string(op) + ": " + std::string(message));
}

// XLA's short name of `dtype` ("f32", "bf16", ...), for messages.
inline std::string_view DataTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::INVALID:
      return "invalid";
    case ffi::PRED:
      return "pred";
    case ffi::S1:
      return "s1";
    case ffi::S2:
      return "s2";
    case ffi::S4:
      return "s4";
    case ffi::S8:
      return "s8";
    case ffi::S16:
      return "s16";
    case ffi::S32:
      return "s32";
    case ffi::S64:
      return "s64";
    case ffi::U1:
      return "u1";
    case ffi::U2:
      return "u2";
    case ffi::U4:
      return "u4";
    case ffi::U8:
      return "u8";
    case ffi::U16:
      return "u16";
    case ffi::U32:
      return "u32";
    case ffi::U64:
      return "u64";
    case ffi::F16:
      return "f16";
    case ffi::F32:
      return "f32";
    case ffi::F64:
      return "f64";
    case ffi::BF16:
      return "bf16";
    case ffi::C64:
      return "c64";
    case ffi::C128:
      return "c128";
    case ffi::TOKEN:
      return "token";
    case ffi::F8E5M2:
      return "f8e5m2";
    case ffi::F8E4M3:
      return "f8e4m3";
    case ffi::F8E4M3FN:
      return "f8e4m3fn";
    case ffi::F8E4M3B11FNUZ:
      return "f8e4m3b11fnuz";
    case ffi::F8E5M2FNUZ:
      return "f8e5m2fnuz";
    case ffi::F8E4M3FNUZ:
      return "f8e4m3fnuz";
    case ffi::F8E3M4:
      return "f8e3m4";
    case ffi::F4E2M1FN:
      return "f4e2m1fn";
    case ffi::F8E8M0FNU:
      return "f8e8m0fnu";
  }
  return "unknown";
}

// The FloatType of `dtype`, or none for another dtype.
inline std::optional<FloatType> FloatTypeOf(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::F32:
      return FloatType::kF32;
    case ffi::BF16:
      return FloatType::kBF16;
    case ffi::F16:
      return FloatType::kF16;
    default:
      return std::nullopt;
  }
}

// The 8-bit wire's token type of `dtype` (the dtype of `what`, which rows on the wire convert from or to).
inline ffi::ErrorOr<FloatType> WireTokenType(std::string_view op, std::string_view what, ffi::DataType dtype) {
  if (std::optional<FloatType> type = FloatTypeOf(dtype)) return *type;
  return InvalidArgument(op, "an 8-bit wire takes f32, bf16 or f16 " + std::string(what) + ", got " +
                                 std::string(DataTypeName(dtype)));
}

// A reduction as the handlers run it: the reduce_op attribute (0 sum, 1 max, 2 min) checked and decoded, and
// what it adds or compares for a buffer of the operand's dtype: complex numbers sum as (real, imaginary) pairs
// of their real dtype and booleans take max / min (any / all) as bytes, so the handlers reduce both in place
// rather than after a copy.
struct ReducedDtype {
  ReduceOp op;
  ffi::DataType dtype;
  int64_t per_element;  // values of `dtype` in one element of the buffer
};

inline ffi::ErrorOr<ReducedDtype> GetReducedDtype(std::string_view op, ffi::DataType dtype, ReduceOp decoded) {
  if (!ValidReduceOp(decoded)) {
    return InvalidArgument(op, "reduce_op is " + std::to_string(static_cast<int>(decoded)) +
                                   ", expected 0 (sum), 1 (max) or 2 (min)");
  }
  switch (dtype) {
    case ffi::C64:
    case ffi::C128:
      if (decoded != ReduceOp::kSum) {
        return InvalidArgument(op, "cannot take the max or min of dtype " + std::string(DataTypeName(dtype)) +
                                       ": complex numbers have no order");
      }
      return ReducedDtype{decoded, dtype == ffi::C64 ? ffi::F32 : ffi::F64, 2};
    case ffi::PRED:
      if (decoded == ReduceOp::kSum) {
        return InvalidArgument(op,
                               "cannot sum dtype pred into pred; a sum of booleans is counted in s32 (jax_ncclx "
                               "casts them before the call)");
      }
      return ReducedDtype{decoded, ffi::U8, 1};
    default:
      return ReducedDtype{decoded, dtype, 1};
  }
}

// "[2, 3]", for messages about shapes.
template <typename Dims>
std::string DimsString(const Dims& dims) {
  std::string text = "[";
  for (const int64_t dim : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(dim);
  return text + "]";
}

// The data of an optional buffer argument, or null when the call did not pass it.
inline const void* OptionalData(const std::optional<ffi::AnyBuffer>& buffer) {
  return buffer.has_value() ? buffer->untyped_data() : nullptr;
}
template <ffi::DataType dtype>
const ffi::NativeType<dtype>* OptionalData(const std::optional<ffi::Buffer<dtype>>& buffer) {
  return buffer.has_value() ? buffer->typed_data() : nullptr;
}

// The product of `factors` (each >= 0), or nothing where it overflows int64: attributes come from the caller
// and sizes computed from them must not wrap around into a size some buffer passes.
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t factor : factors) {
    if (__builtin_mul_overflow(product, factor, &product)) return std::nullopt;
  }
  return product;
}

// InvalidArgument unless the operand `name` has whole-byte elements: XLA packs sub-byte types (int4, ...) two
// or more to a byte, where the FFI's size_bytes() counts one byte each, and every size would overrun.
inline ffi::Error CheckWholeBytes(std::string_view op, std::string_view name, ffi::DataType dtype) {
  switch (dtype) {
    case ffi::S1:
    case ffi::S2:
    case ffi::S4:
    case ffi::U1:
    case ffi::U2:
    case ffi::U4:
    case ffi::F4E2M1FN:
      return InvalidArgument(op, std::string(name) + " has dtype " + std::string(DataTypeName(dtype)) +
                                     ", expected whole-byte elements (sub-byte types are packed)");
    default:
      return ffi::Error::Success();
  }
}

// InvalidArgument naming the operand `name` unless its dimensions are `expected`.
inline ffi::Error CheckDims(std::string_view op, std::string_view name, ffi::Span<const int64_t> dims,
                            std::initializer_list<int64_t> expected) {
  if (std::equal(dims.begin(), dims.end(), expected.begin(), expected.end())) return ffi::Error::Success();
  return InvalidArgument(op,
                         std::string(name) + " has shape " + DimsString(dims) + ", expected " + DimsString(expected));
}

// InvalidArgument naming the operand `name` unless its dtype is `expected`.
inline ffi::Error CheckDtype(std::string_view op, std::string_view name, const ffi::AnyBuffer& buffer,
                             ffi::DataType expected) {
  if (buffer.element_type() == expected) return ffi::Error::Success();
  return InvalidArgument(op, std::string(name) + " has dtype " + std::string(DataTypeName(buffer.element_type())) +
                                 ", expected " + std::string(DataTypeName(expected)));
}

// InvalidArgument naming the operand `name` unless it has dtype `dtype` and dimensions `dims`.
inline ffi::Error CheckBuffer(std::string_view op, std::string_view name, const ffi::AnyBuffer& buffer,
                              ffi::DataType dtype, std::initializer_list<int64_t> dims) {
  if (buffer.element_type() != dtype) return CheckDtype(op, name, buffer, dtype);
  return CheckDims(op, name, buffer.dimensions(), dims);
}

// A positive value that never changes in the process (a device attribute, an occupancy), asked of `query` (an
// ffi::ErrorOr<int>) once and then read from `known` (0: not asked yet). Handlers of every device share it.
template <typename Query>
ffi::ErrorOr<int> AskOnce(std::atomic<int>& known, Query query) {
  if (const int cached = known.load(std::memory_order_relaxed); cached > 0) return cached;
  ffi::ErrorOr<int> value = query();
  if (!value.has_error()) known.store(*value, std::memory_order_relaxed);
  return value;
}

}  // namespace jax_ncclx

#define NCCLX_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::xla::ffi::Error ncclx_error_ = (expr);         \
    if (ncclx_error_.failure()) return ncclx_error_; \
  } while (false)
