// The contract's enums (contract.h) as typed FFI attributes: a handler binds .Attr<ReduceOp>("reduce_op") and
// gets the enum, decoded from the int32 scalar the lowering passes. A value outside the enum still decodes,
// so handlers check it (the Valid* functions) and name it in their error.
#pragma once

#include "common/contract.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::ReduceOp);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::NvlinkProtocol);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::NvlinkAlgorithm);

namespace jax_ncclx {

inline bool ValidReduceOp(ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kMax || op == ReduceOp::kMin; }
inline bool ValidNvlinkProtocol(NvlinkProtocol protocol) {
  return protocol == NvlinkProtocol::kLL128 || protocol == NvlinkProtocol::kLL || protocol == NvlinkProtocol::kSimple;
}
inline bool ValidNvlinkAlgorithm(NvlinkAlgorithm algorithm) {
  return algorithm == NvlinkAlgorithm::kOneShot || algorithm == NvlinkAlgorithm::kTwoShot;
}

}  // namespace jax_ncclx
