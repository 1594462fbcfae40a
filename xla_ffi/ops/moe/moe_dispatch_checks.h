// The operands of moe.dispatch's NVLink kernels (the packed layout's, moe_dispatch.h, and the masked layout's,
// moe_masked.h), read and checked once for both handlers, so that both refuse the same bad calls with the same
// messages. Each handler then checks its own kernel's limits and results.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/contract.h"
#include "ops/moe/moe_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

// An int32 result's data, for the kernels' arguments.
inline int32_t* Ints(ffi::Result<ffi::AnyBuffer>& buffer) { return static_cast<int32_t*>(buffer->untyped_data()); }

struct DispatchOperands {
  int64_t tokens = 0;          // T
  int64_t hidden = 0;          // H
  int64_t top_k = 0;           // k
  int64_t row_bytes = 0;       // H * the tokens' element bytes
  int64_t wire_row_bytes = 0;  // a row's bytes on the wire (MoeDispatchWireRowBytes)
  FloatType token_type = FloatType::kF32;  // the tokens' dtype where it is one of FloatType's, else kF32
  const float* weights = nullptr;          // [T, k] float32, or null without weights
};

// tokens [T, H], expert_ids [T, k] int32, at most one weights operand, [T, k] float32, and a MoeWire whose rows
// the kernels write: H a multiple of kMoeWireBlock and wire rows of whole 16-byte vectors on an 8-bit wire.
// On an 8-bit wire, or with `float_tokens`, the tokens must be f32, bf16 or f16.
inline ffi::ErrorOr<DispatchOperands> ReadDispatchOperands(std::string_view op, ffi::AnyBuffer tokens,
                                                           ffi::AnyBuffer expert_ids, ffi::RemainingArgs weights,
                                                           MoeWire wire, bool float_tokens) {
  const auto token_dims = tokens.dimensions();
  const auto id_dims = expert_ids.dimensions();
  if (token_dims.size() != 2 || id_dims.size() != 2 || id_dims[0] != token_dims[0]) {
    return InvalidArgument(op, "tokens must be [T, H] and expert_ids [T, k], got " + DimsString(token_dims) + " and " +
                                   DimsString(id_dims));
  }
  NCCLX_RETURN_IF_ERROR(CheckDtype(op, "expert_ids", expert_ids, ffi::S32));
  if (!ValidMoeWire(wire)) {
    return InvalidArgument(op, "wire " + std::to_string(static_cast<int>(wire)) + " is not a MoeWire (contract.h)");
  }
  DispatchOperands read;
  read.tokens = token_dims[0];
  read.hidden = token_dims[1];
  read.top_k = id_dims[1];
  const int64_t element_bytes = ffi::ByteWidth(tokens.element_type());
  read.row_bytes = read.hidden * element_bytes;
  read.wire_row_bytes = MoeDispatchWireRowBytes(read.hidden, element_bytes, wire);
  if (std::optional<FloatType> type = FloatTypeOf(tokens.element_type())) {
    read.token_type = *type;
  } else if (float_tokens) {
    return InvalidArgument(op, "the NVLink kernel takes f32, bf16 or f16 tokens, got " +
                                   std::string(DataTypeName(tokens.element_type())) + " (others take the chain)");
  } else if (wire != MoeWire::kNone) {
    return WireTokenType(op, "tokens", tokens.element_type()).error();
  }
  if (wire != MoeWire::kNone && (read.hidden % kMoeWireBlock != 0 || read.wire_row_bytes % 16 != 0)) {
    return InvalidArgument(op, "the NVLink kernel's 8-bit wire takes H a multiple of " + std::to_string(kMoeWireBlock) +
                                   " whose wire row (" + std::to_string(read.wire_row_bytes) +
                                   " bytes) is a multiple of 16; got H = " + std::to_string(read.hidden) +
                                   " (other rows take the chain)");
  }
  if (weights.size() > 1) {
    return InvalidArgument(op, "takes tokens, expert_ids and at most one weights operand, got " +
                                   std::to_string(2 + weights.size()) + " operands");
  }
  if (weights.size() == 1) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = weights.get<ffi::AnyBuffer>(0);
    if (buffer.has_error()) return buffer.error();
    NCCLX_RETURN_IF_ERROR(CheckBuffer(op, "weights", *buffer, ffi::F32, {read.tokens, read.top_k}));
    read.weights = static_cast<const float*>(buffer->untyped_data());
  }
  return read;
}

}  // namespace jax_ncclx
