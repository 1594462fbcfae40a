// Decoding and checking of take_rows' FFI arguments, shared by the CPU and CUDA handlers, so that both refuse
// the same bad calls with the same messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/checks.h"
#include "ops/take_rows/take_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline constexpr std::string_view kTakeRowsOp = "take_rows";
inline constexpr std::string_view kExpandRowsOp = "expand_rows";
inline constexpr std::string_view kEncodeRowsOp = "encode_rows";

// x [B, X, F], index [B, M], suffix [B, M, G] (x's dtype) and out [B, M, W + G] (x's dtype), W <= F.
inline ffi::ErrorOr<TakeRowsShape> GetTakeRowsShape(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& index,
                                                    const std::optional<ffi::AnyBuffer>& suffix,
                                                    const ffi::AnyBuffer& out, std::string_view op = kTakeRowsOp) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 3) {
    return InvalidArgument(op, "x has shape " + DimsString(x_dims) + ", expected [batch, rows, features]");
  }
  const auto index_dims = index.dimensions();
  if (index_dims.size() != 2 || index_dims[0] != x_dims[0]) {
    return InvalidArgument(op, "index has shape " + DimsString(index_dims) + ", expected [" +
                                   std::to_string(x_dims[0]) + ", rows] (x's batch)");
  }
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(op, "x", x.element_type()));
  const int64_t item = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  TakeRowsShape shape{x_dims[0], x_dims[1], index_dims[1], x_dims[2] * item, 0, 0};
  int64_t suffix_width = 0;
  if (suffix.has_value()) {
    const auto suffix_dims = suffix->dimensions();
    if (suffix->element_type() != x.element_type() || suffix_dims.size() != 3 || suffix_dims[0] != shape.batch ||
        suffix_dims[1] != shape.rows) {
      return InvalidArgument(op, "suffix is " + std::string(DataTypeName(suffix->element_type())) +
                                     DimsString(suffix_dims) + ", expected x's " +
                                     std::string(DataTypeName(x.element_type())) + " and [" +
                                     std::to_string(shape.batch) + ", " + std::to_string(shape.rows) +
                                     ", columns] (index's rows)");
    }
    suffix_width = suffix_dims[2];
    shape.suffix_bytes = suffix_width * item;
  }
  const auto out_dims = out.dimensions();
  if (out.element_type() != x.element_type() || out_dims.size() != 3 || out_dims[0] != shape.batch ||
      out_dims[1] != shape.rows || out_dims[2] < suffix_width || out_dims[2] - suffix_width > x_dims[2]) {
    return InvalidArgument(op, "out is " + std::string(DataTypeName(out.element_type())) + DimsString(out_dims) +
                                   ", expected x's dtype and [" + std::to_string(shape.batch) + ", " +
                                   std::to_string(shape.rows) + ", width + " + std::to_string(suffix_width) +
                                   "] with width <= " + std::to_string(x_dims[2]) + " (x's columns)");
  }
  shape.take_bytes = (out_dims[2] - suffix_width) * item;
  return shape;
}

// What an expand_rows call reads and writes: its shape (take_bytes: an output row's bytes), k, and for rows on
// the 8-bit wire the tokens' type they decode to.
struct ExpandRowsCall {
  TakeRowsShape shape;
  int32_t top_k = 0;
  FloatType token = FloatType::kF32;
};

// expand_rows: x [B, X, F], index [B, M], sources [B, X, k] int32 and out [B, M, W], W <= F, with x's dtype; on
// the 8-bit wire x is uint8 rows of H values of the wire, H / kMoeWireBlock float32 scales and any suffix
// (F bytes, a multiple of 8), and out is [B, M, H] float32, bfloat16 or float16 (H a multiple of
// kMoeWireBlock).
inline ffi::ErrorOr<ExpandRowsCall> GetExpandRowsCall(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& index,
                                                      const ffi::Buffer<ffi::S32>& sources, const ffi::AnyBuffer& out,
                                                      MoeWire wire) {
  constexpr std::string_view op = kExpandRowsOp;
  ExpandRowsCall call;
  if (wire == MoeWire::kNone) {
    ffi::ErrorOr<TakeRowsShape> shape = GetTakeRowsShape(x, index, std::nullopt, out, op);
    if (shape.has_error()) return shape.error();
    call.shape = *shape;
  } else {
    if (!ValidMoeWire(wire)) {
      return InvalidArgument(op, "wire " + std::to_string(static_cast<int>(wire)) + " is not a MoeWire (contract.h)");
    }
    const auto x_dims = x.dimensions(), index_dims = index.dimensions(), out_dims = out.dimensions();
    if (x.element_type() != ffi::U8 || x_dims.size() != 3) {
      return InvalidArgument(op, "x is " + std::string(DataTypeName(x.element_type())) + DimsString(x_dims) +
                                     ", expected u8[batch, rows, bytes] (rows on the 8-bit wire)");
    }
    if (index_dims.size() != 2 || index_dims[0] != x_dims[0]) {
      return InvalidArgument(op, "index has shape " + DimsString(index_dims) + ", expected [" +
                                     std::to_string(x_dims[0]) + ", rows] (x's batch)");
    }
    ffi::ErrorOr<FloatType> token = WireTokenType(op, "out", out.element_type());
    if (token.has_error()) return token.error();
    call.token = *token;
    const int64_t hidden = out_dims.size() == 3 ? out_dims[2] : -1;
    if (out_dims.size() != 3 || out_dims[0] != x_dims[0] || out_dims[1] != index_dims[1] || hidden < 0 ||
        hidden % kMoeWireBlock != 0 || hidden + 4 * (hidden / kMoeWireBlock) > x_dims[2] || x_dims[2] % 8 != 0) {
      return InvalidArgument(op, "out has shape " + DimsString(out_dims) + " and x " + DimsString(x_dims) +
                                     ", expected out [" + std::to_string(x_dims[0]) + ", " +
                                     std::to_string(index_dims[1]) + ", H] with H a multiple of " +
                                     std::to_string(kMoeWireBlock) + " whose wire row (H + 4 * H / " +
                                     std::to_string(kMoeWireBlock) + " bytes) fits x's rows, a multiple of 8 bytes");
    }
    const int64_t item = static_cast<int64_t>(ffi::ByteWidth(out.element_type()));
    call.shape = TakeRowsShape{x_dims[0], x_dims[1], index_dims[1], x_dims[2], hidden * item, 0};
  }
  const auto dims = sources.dimensions();
  if (dims.size() != 3 || dims[0] != call.shape.batch || dims[1] != call.shape.source_rows || dims[2] < 1 ||
      dims[2] > (int64_t{1} << 20)) {
    return InvalidArgument(op, "sources has shape " + DimsString(dims) + ", expected [" +
                                   std::to_string(call.shape.batch) + ", " + std::to_string(call.shape.source_rows) +
                                   ", k] (x's batch and rows, 1 <= k <= 2^20)");
  }
  call.top_k = static_cast<int32_t>(dims[2]);
  return call;
}

// What an encode_rows call converts: B * X rows of H tokens of `token` into rows on the 8-bit wire `wire`.
struct EncodeRowsCall {
  int64_t rows = 0;    // B * X
  int64_t hidden = 0;  // H, a multiple of kMoeWireBlock
  FloatType token = FloatType::kF32;
  MoeWire wire = MoeWire::kE4M3;
};

// encode_rows: x [B, X, H] float32, bfloat16 or float16 with H a multiple of kMoeWireBlock, and out
// [B, X, H + 4 * H / kMoeWireBlock] uint8; wire one of the 8-bit formats.
inline ffi::ErrorOr<EncodeRowsCall> GetEncodeRowsCall(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out,
                                                      MoeWire wire) {
  constexpr std::string_view op = kEncodeRowsOp;
  if (wire == MoeWire::kNone || !ValidMoeWire(wire)) {
    return InvalidArgument(op,
                           "wire " + std::to_string(static_cast<int>(wire)) + " is not an 8-bit MoeWire (contract.h)");
  }
  ffi::ErrorOr<FloatType> token = WireTokenType(op, "x", x.element_type());
  if (token.has_error()) return token.error();
  const auto x_dims = x.dimensions(), out_dims = out.dimensions();
  const int64_t hidden = x_dims.size() == 3 ? x_dims[2] : -1;
  if (hidden < 0 || hidden % kMoeWireBlock != 0) {
    return InvalidArgument(op, "x has shape " + DimsString(x_dims) +
                                   ", expected [batch, rows, H] with H a multiple of " + std::to_string(kMoeWireBlock));
  }
  const int64_t wire_bytes = hidden + 4 * (hidden / kMoeWireBlock);
  if (out.element_type() != ffi::U8 || out_dims.size() != 3 || out_dims[0] != x_dims[0] || out_dims[1] != x_dims[1] ||
      out_dims[2] != wire_bytes) {
    return InvalidArgument(op, "out is " + std::string(DataTypeName(out.element_type())) + DimsString(out_dims) +
                                   ", expected u8[" + std::to_string(x_dims[0]) + ", " + std::to_string(x_dims[1]) +
                                   ", " + std::to_string(wire_bytes) + "] (H values, then H / " +
                                   std::to_string(kMoeWireBlock) + " float32 scales)");
  }
  return EncodeRowsCall{x_dims[0] * x_dims[1], hidden, *token, wire};
}

// The buffers both handlers bind (after any context).
template <typename Binding>
auto BindTakeRows(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [B, X, F]
      .template Arg<ffi::Buffer<ffi::S32>>()                // index [B, M]
      .template OptionalArg<ffi::AnyBuffer>()               // suffix [B, M, G]
      .template Ret<ffi::AnyBuffer>();                      // out [B, M, W + G]
}

template <typename Binding>
auto BindExpandRows(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()        // x [B, X, F]
      .template Arg<ffi::Buffer<ffi::S32>>()  // index [B, M]
      .template Arg<ffi::Buffer<ffi::S32>>()  // sources [B, X, k]
      .template Ret<ffi::AnyBuffer>()         // out [B, M, W], or [B, M, H] decoded from the 8-bit wire
      .template Attr<MoeWire>("wire");        // how x's rows are (contract.h): as they are, or on the 8-bit wire
}

template <typename Binding>
auto BindEncodeRows(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [B, X, H] float32, bfloat16 or float16
      .template Ret<ffi::AnyBuffer>()  // out [B, X, H + 4 * H / 128] uint8: H values, then the float32 scales
      .template Attr<MoeWire>("wire");  // the 8-bit format (contract.h)
}

}  // namespace jax_ncclx
