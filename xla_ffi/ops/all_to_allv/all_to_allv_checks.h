// Decoding and checking of all_to_allv_dynamic's operands (the send side x, send_rows, suffix; the receive side
// counts, y, recv_counts, dropped), shared by the CPU and CUDA handlers so that both refuse the same bad calls
// with the same messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline constexpr std::string_view kAllToAllvOp = "all_to_allv_dynamic";
// The same handlers serve ragged_all_to_all's exchange, whose errors name it.
inline constexpr std::string_view kRaggedAllToAllOp = "ragged_all_to_all";

// all_to_allv_dynamic's `exchange` attribute, a dictionary (all_to_allv_dynamic.py, _all_to_allv_dynamic_attrs).
struct ExchangeAttrs {
  int64_t capacity = 0;  // C: rows kept per source
  bool packed = false;   // y packs the received rows ([B, N * C, ...]) instead of padding each source's to C
};

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
inline ffi::ErrorOr<AllToAllvSendRows> GetSendRows(std::string_view op, const ffi::AnyBuffer& x,
                                                   const std::optional<ffi::Buffer<ffi::S32>>& send_rows,
                                                   const std::optional<ffi::AnyBuffer>& suffix) {
  const ffi::Span<const int64_t> x_dims = x.dimensions();
  if (x_dims.size() < 2) {
    return InvalidArgument(op, "x has shape " + DimsString(x_dims) + ", expected [batch, rows, features...]");
  }
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(op, "x", x.element_type()));
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
    return InvalidArgument(op,
                           "x has shape " + DimsString(x_dims) + " with a suffix, expected [batch, rows, features]");
  }
  if (suffix->element_type() != x.element_type() || suffix_dims.size() != 3 || suffix_dims[0] != rows.batch ||
      suffix_dims[1] != rows.num_rows) {
    return InvalidArgument(op, "suffix is " + std::string(DataTypeName(suffix->element_type())) +
                                   DimsString(suffix_dims) + ", expected x's " +
                                   std::string(DataTypeName(x.element_type())) + " and [" + std::to_string(rows.batch) +
                                   ", " + std::to_string(rows.num_rows) + ", columns] (send_rows' rows)");
  }
  rows.suffix_bytes = suffix_dims[2] * item;
  rows.row_bytes += rows.suffix_bytes;
  return rows;
}

// The rest against the send side and the group of num_ranks: capacity >= 0, counts [B, N, K],
// recv_counts [B, N, K], dropped [B, N] and y of x's dtype holding B x N x capacity rows (unless `placed`:
// CheckPlace checks y then). Returns K.
inline ffi::ErrorOr<int64_t> CheckReceiveSide(std::string_view op, const AllToAllvSendRows& rows,
                                              const ffi::AnyBuffer& x, ffi::Span<const int64_t> counts_dims,
                                              const ffi::AnyBuffer& y, ffi::Span<const int64_t> recv_counts_dims,
                                              ffi::Span<const int64_t> dropped_dims, int64_t num_ranks,
                                              int64_t capacity, bool placed = false) {
  if (capacity < 0 || capacity > kMaxCapacity) {
    return InvalidArgument(op, "capacity is " + std::to_string(capacity) + ", expected 0 to 2^31 - 1");
  }
  if (counts_dims.size() != 3 || counts_dims[0] != rows.batch || counts_dims[1] != num_ranks) {
    return InvalidArgument(op, "counts has shape " + DimsString(counts_dims) + ", expected [" +
                                   std::to_string(rows.batch) + ", " + std::to_string(num_ranks) +
                                   ", chunks] (x's batch, the group's ranks)");
  }
  const int64_t num_chunks = counts_dims[2];
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "recv_counts", recv_counts_dims, {rows.batch, num_ranks, num_chunks}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "dropped", dropped_dims, {rows.batch, num_ranks}));
  if (y.element_type() != x.element_type()) {
    return InvalidArgument(op, "y has dtype " + std::string(DataTypeName(y.element_type())) + ", expected x's " +
                                   std::string(DataTypeName(x.element_type())));
  }
  if (placed) return num_chunks;
  const std::optional<int64_t> y_bytes = CheckedProduct({rows.batch, num_ranks, capacity, rows.row_bytes});
  if (!y_bytes.has_value() || static_cast<int64_t>(y.size_bytes()) != *y_bytes) {
    return InvalidArgument(op, "y has " + std::to_string(y.size_bytes()) + " bytes, expected batch " +
                                   std::to_string(rows.batch) + " x " + std::to_string(num_ranks) +
                                   " ranks x capacity " + std::to_string(capacity) + " x " +
                                   std::to_string(rows.row_bytes) + " bytes per row");
  }
  return num_chunks;
}

// A placed call (ragged_all_to_all): place int32 [B, N * C] and y [B, O, F...] with whole rows of the send
// side's row_bytes. Returns O.
inline ffi::ErrorOr<int64_t> CheckPlace(std::string_view op, const AllToAllvSendRows& rows,
                                        ffi::Span<const int64_t> place_dims, const ffi::AnyBuffer& y, int64_t num_ranks,
                                        int64_t capacity) {
  const std::optional<int64_t> slots = CheckedProduct({num_ranks, capacity});
  if (!slots.has_value()) return InvalidArgument(op, "ranks x capacity overflows int64");
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "place", place_dims, {rows.batch, *slots}));
  const ffi::Span<const int64_t> y_dims = y.dimensions();
  const int64_t out_rows = y_dims.size() >= 2 ? y_dims[1] : -1;
  const std::optional<int64_t> y_bytes = CheckedProduct({rows.batch, out_rows, rows.row_bytes});
  if (y_dims.size() < 2 || y_dims[0] != rows.batch || !y_bytes.has_value() ||
      static_cast<int64_t>(y.size_bytes()) != *y_bytes) {
    return InvalidArgument(op, "output has shape " + DimsString(y_dims) + " (" + std::to_string(y.size_bytes()) +
                                   " bytes), expected [" + std::to_string(rows.batch) + ", rows, ...] of " +
                                   std::to_string(rows.row_bytes) + " bytes per row");
  }
  return out_rows;
}

}  // namespace jax_ncclx

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::ExchangeAttrs, ::xla::ffi::StructMember<int64_t>("capacity"),
                                      ::xla::ffi::StructMember<bool>("packed"));
