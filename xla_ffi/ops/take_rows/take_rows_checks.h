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

// expand_rows: x [B, X, F], index [B, M], sources [B, X, k] int32 and out [B, M, W] (x's dtype), W <= F.
// Returns the shape and k.
inline ffi::ErrorOr<std::pair<TakeRowsShape, int32_t>> GetExpandRowsShape(const ffi::AnyBuffer& x,
                                                                          const ffi::Buffer<ffi::S32>& index,
                                                                          const ffi::Buffer<ffi::S32>& sources,
                                                                          const ffi::AnyBuffer& out) {
  ffi::ErrorOr<TakeRowsShape> shape = GetTakeRowsShape(x, index, std::nullopt, out, kExpandRowsOp);
  if (shape.has_error()) return shape.error();
  const auto dims = sources.dimensions();
  if (dims.size() != 3 || dims[0] != shape->batch || dims[1] != shape->source_rows || dims[2] < 1 ||
      dims[2] > (int64_t{1} << 20)) {
    return InvalidArgument(kExpandRowsOp, "sources has shape " + DimsString(dims) + ", expected [" +
                                              std::to_string(shape->batch) + ", " + std::to_string(shape->source_rows) +
                                              ", k] (x's batch and rows, 1 <= k <= 2^20)");
  }
  return std::make_pair(*shape, static_cast<int32_t>(dims[2]));
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
      .template Ret<ffi::AnyBuffer>();        // out [B, M, W]
}

}  // namespace jax_ncclx
