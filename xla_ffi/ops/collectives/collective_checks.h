// Size, dtype and pairing checks shared by the CPU, NCCL and NVLink handlers of the fixed-size collectives.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline int64_t Bytes(const ffi::AnyBuffer& buffer) { return static_cast<int64_t>(buffer.size_bytes()); }

// `what` is "input" or "output"; `expected` says where the expected size comes from.
inline ffi::Error CheckBytes(std::string_view op, std::string_view what, int64_t bytes, int64_t expected_bytes,
                             const std::string& expected) {
  if (bytes == expected_bytes) return ffi::Error::Success();
  return InvalidArgument(op, std::string(what) + " has " + std::to_string(bytes) + " bytes, expected " + expected);
}

// An output the size of the input (all_reduce, all_to_all, ppermute).
inline ffi::Error CheckSameBytes(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return CheckBytes(op, "output", Bytes(y), Bytes(x), "the input's " + std::to_string(Bytes(x)));
}

inline std::string RanksTimes(int64_t ranks, int64_t bytes) {
  return std::to_string(ranks) + " ranks x " + std::to_string(bytes) + " bytes";
}

inline ffi::Error CheckSameDtype(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.element_type() == y.element_type()) return ffi::Error::Success();
  return InvalidArgument(op, "output has dtype " + std::string(DataTypeName(y.element_type())) +
                                 ", expected the input's " + std::string(DataTypeName(x.element_type())));
}

// all_to_all: x must split into one equal block per rank.
inline ffi::Error CheckEvenSplit(std::string_view op, int64_t bytes, int64_t ranks) {
  if (ranks > 0 && bytes % ranks == 0) return ffi::Error::Success();
  return InvalidArgument(op, "input has " + std::to_string(bytes) + " bytes, which do not split into " +
                                 std::to_string(ranks) + " equal per-rank blocks");
}

// Every rank sees the same sources/targets, so checking that they describe one consistent set of pairs
// makes all ranks fail together instead of leaving a send or receive without its partner (a hang).
inline ffi::Error CheckPairs(std::string_view op, ffi::Span<const int64_t> sources, ffi::Span<const int64_t> targets,
                             int64_t size) {
  if (static_cast<int64_t>(sources.size()) != size || static_cast<int64_t>(targets.size()) != size) {
    return InvalidArgument(op, "sources has " + std::to_string(sources.size()) + " entries and targets " +
                                   std::to_string(targets.size()) + ", expected one per rank (" + std::to_string(size) +
                                   ")");
  }
  for (int64_t r = 0; r < size; ++r) {
    const int64_t source = sources[r];
    const int64_t target = targets[r];
    if (source < -1 || source >= size || target < -1 || target >= size) {
      return InvalidArgument(op, "sources[" + std::to_string(r) + "] = " + std::to_string(source) + " and targets[" +
                                     std::to_string(r) + "] = " + std::to_string(target) +
                                     " must each be -1 or a rank below " + std::to_string(size));
    }
  }
  for (int64_t r = 0; r < size; ++r) {
    const int64_t target = targets[r];
    if (target >= 0 && sources[target] != r) {
      return InvalidArgument(op, "targets[" + std::to_string(r) + "] = " + std::to_string(target) + " but sources[" +
                                     std::to_string(target) + "] = " + std::to_string(sources[target]) + ", expected " +
                                     std::to_string(r));
    }
    const int64_t source = sources[r];
    if (source >= 0 && targets[source] != r) {
      return InvalidArgument(op, "sources[" + std::to_string(r) + "] = " + std::to_string(source) + " but targets[" +
                                     std::to_string(source) + "] = " + std::to_string(targets[source]) + ", expected " +
                                     std::to_string(r));
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_ncclx
