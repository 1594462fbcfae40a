// Error helpers shared by every handler: failures become ffi::Error values that name the op, the argument
// and the problem. Handlers never abort the process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(std::string_view op, std::string_view message) {
  return ffi::Error::InvalidArgument("jax_ncclx " + std::string(op) + ": " + std::string(message));
}

inline ffi::Error Internal(std::string_view op, std::string_view message) {
  return ffi::Error::Internal("jax_ncclx " + std::string(op) + ": " + std::string(message));
}

inline ffi::Error DeadlineExceeded(std::string_view op, std::string_view message) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    "jax_ncclx " + std::string(op) + ": " + std::string(message));
}

// "[2, 3]", for messages about shapes.
template <typename Dims>
std::string DimsString(const Dims& dims) {
  std::string text = "[";
  for (const int64_t dim : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(dim);
  return text + "]";
}

// InvalidArgument naming the operand `name` unless its dimensions are `expected`.
inline ffi::Error CheckDims(std::string_view op, std::string_view name, ffi::Span<const int64_t> dims,
                            std::initializer_list<int64_t> expected) {
  if (std::equal(dims.begin(), dims.end(), expected.begin(), expected.end())) return ffi::Error::Success();
  return InvalidArgument(op, std::string(name) + " has shape " + DimsString(dims) + ", expected " +
                                 DimsString(expected));
}

}  // namespace jax_ncclx

#define NCCLX_RETURN_IF_ERROR(expr)         \
  do {                                      \
    ::xla::ffi::Error ncclx_error_ = (expr); \
    if (ncclx_error_.failure()) return ncclx_error_; \
  } while (false)
