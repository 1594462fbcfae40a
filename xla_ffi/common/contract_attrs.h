// Typed FFI attributes: the handlers' common `call` dictionary, and the contract's enums (contract.h): a handler binds .Attr<ReduceOp>("reduce_op") and
// gets the enum, decoded from the int32 scalar the lowering passes. A value outside the enum still decodes,
// so handlers check it (the Valid* functions) and name it in their error.
#pragma once

#include "common/contract.h"
#include "common/monitor.h"
#include "xla/ffi/api/ffi.h"

// Every handler's `call` attribute: a dictionary the lowering fills (lowering.py, _lower).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::RawCallAttrs, ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("timeout_ms"),
                                      ::xla::ffi::StructMember<int64_t>("warn_ms"),
                                      ::xla::ffi::StructMember<int64_t>("trace"));

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::ReduceOp);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::NvlinkProtocol);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::NvlinkAlgorithm);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_ncclx::MoeWire);

namespace jax_ncclx {

inline bool ValidReduceOp(ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kMax || op == ReduceOp::kMin; }
inline bool ValidNvlinkProtocol(NvlinkProtocol protocol) {
  return protocol == NvlinkProtocol::kLL128 || protocol == NvlinkProtocol::kLL || protocol == NvlinkProtocol::kSimple;
}
inline bool ValidNvlinkAlgorithm(NvlinkAlgorithm algorithm) {
  return algorithm == NvlinkAlgorithm::kOneShot || algorithm == NvlinkAlgorithm::kTwoShot;
}
inline bool ValidMoeWire(MoeWire wire) {
  return wire == MoeWire::kNone || wire == MoeWire::kE4M3 || wire == MoeWire::kE5M2;
}

}  // namespace jax_ncclx
