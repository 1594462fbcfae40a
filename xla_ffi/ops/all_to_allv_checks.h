// Decoding and checking of the send side of all_to_allv_dynamic (x, send_rows, suffix), shared by the CPU and
// CUDA handlers so that both refuse the same bad calls with the same messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline constexpr std::string_view kAllToAllvOp = "all_to_allv_dynamic";

// What travels: S send rows of row_bytes each per batch element, the leading row_bytes - suffix_bytes taken
// from x and the rest from the suffix.
struct AllToAllvSendRows {
  int64_t batch = 0;        // B
  int64_t source_rows = 0;  // X, rows of x per batch element
  int64_t num_rows = 0;     // S, send rows per batch element (X without send_rows)
  int64_t row_bytes = 0;
  int64_t suffix_bytes = 0;
};

// x [B, X, F...], send_rows [B, S] and suffix [B, S, G] with x's dtype; a suffix needs send_rows (the FFI
// binds both as optional, in this order) and a 3-D x, whose rows it extends to F + G columns.
inline ffi::ErrorOr<AllToAllvSendRows> GetSendRows(const ffi::AnyBuffer& x,
                                                   const std::optional<ffi::Buffer<ffi::S32>>& send_rows,
                                                   const std::optional<ffi::AnyBuffer>& suffix) {
  constexpr std::string_view op = kAllToAllvOp;
  const ffi::Span<const int64_t> x_dims = x.dimensions();
  if (x_dims.size() < 2) {
    return InvalidArgument(op, "x has shape " + DimsString(x_dims) + ", expected [batch, rows, features...]");
  }
  AllToAllvSendRows rows;
  rows.batch = x_dims[0];
  rows.source_rows = x_dims[1];
  rows.num_rows = x_dims[1];
  if (send_rows.has_value()) {
    const ffi::Span<const int64_t> rows_dims = send_rows->dimensions();
    if (rows_dims.size() != 2 || rows_dims[0] != rows.batch) {
      return InvalidArgument(op, "send_rows has shape " + DimsString(rows_dims) + ", expected [" +
                                     std::to_string(rows.batch) + ", rows] (x's batch)");
    }
    rows.num_rows = rows_dims[1];
  }
  const int64_t item = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  rows.row_bytes = item;
  for (size_t i = 2; i < x_dims.size(); ++i) rows.row_bytes *= x_dims[i];
  if (!suffix.has_value()) return rows;
  const ffi::Span<const int64_t> suffix_dims = suffix->dimensions();
  if (x_dims.size() != 3) {
    return InvalidArgument(op, "x has shape " + DimsString(x_dims) +
                                   " with a suffix, expected [batch, rows, features]");
  }
  if (suffix->element_type() != x.element_type() || suffix_dims.size() != 3 || suffix_dims[0] != rows.batch ||
      suffix_dims[1] != rows.num_rows) {
    return InvalidArgument(op, "suffix is " + std::string(DataTypeName(suffix->element_type())) +
                                   DimsString(suffix_dims) + ", expected x's " +
                                   std::string(DataTypeName(x.element_type())) + " and [" +
                                   std::to_string(rows.batch) + ", " + std::to_string(rows.num_rows) +
                                   ", columns] (send_rows' rows)");
  }
  rows.suffix_bytes = suffix_dims[2] * item;
  rows.row_bytes += rows.suffix_bytes;
  return rows;
}

}  // namespace jax_ncclx
