// Size and dtype checks shared by the NCCL and NVLink handlers of the fixed-size collectives.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/nccl_comms.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline int64_t Bytes(const ffi::AnyBuffer& buffer) { return static_cast<int64_t>(buffer.size_bytes()); }

// `what` is "input" or "output"; `expected` says where the expected size comes from.
inline ffi::Error CheckBytes(std::string_view op, std::string_view what, int64_t bytes,
                             int64_t expected_bytes, const std::string& expected) {
  if (bytes == expected_bytes) return ffi::Error::Success();
  return InvalidArgument(op, std::string(what) + " has " + std::to_string(bytes) + " bytes, expected " +
                                 expected);
}

inline std::string RanksTimes(int ranks, int64_t bytes) {
  return std::to_string(ranks) + " ranks x " + std::to_string(bytes) + " bytes";
}

inline ffi::Error CheckSameDtype(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.element_type() == y.element_type()) return ffi::Error::Success();
  return InvalidArgument(op, "output has dtype " + std::string(DataTypeName(y.element_type())) +
                                 ", expected the input's " + std::string(DataTypeName(x.element_type())));
}

// all_to_all: x must split into one equal block per rank.
inline ffi::Error CheckEvenSplit(std::string_view op, int64_t bytes, int ranks) {
  if (bytes % ranks == 0) return ffi::Error::Success();
  return InvalidArgument(op, "input has " + std::to_string(bytes) + " bytes, which do not split into " +
                                 std::to_string(ranks) + " equal per-rank blocks");
}

}  // namespace jax_ncclx
