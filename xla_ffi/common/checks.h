// Error helpers shared by every handler: failures become ffi::Error values that name the op, the argument
// and the problem. Handlers never abort the process.
#pragma once

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

}  // namespace jax_ncclx

#define NCCLX_RETURN_IF_ERROR(expr)         \
  do {                                      \
    ::xla::ffi::Error ncclx_error_ = (expr); \
    if (ncclx_error_.failure()) return ncclx_error_; \
  } while (false)
