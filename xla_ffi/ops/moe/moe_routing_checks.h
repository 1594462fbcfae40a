// Decoding and checking of the moe routing ops' FFI arguments, shared by the CPU and CUDA handlers, so that
// both refuse the same bad calls with the same messages.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/checks.h"
#include "ops/moe/moe_routing.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline constexpr std::string_view kPlanSendsOp = "moe plan_sends";
inline constexpr std::string_view kPlaceReceivedOp = "moe place_received";

using Int32Result = ffi::Result<ffi::Buffer<ffi::S32>>;
using Float32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

// The kernels index with int32: every array of one batch element must have fewer than 2^31 entries.
inline ffi::Error CheckIndexable(std::string_view op, std::string_view what, int64_t entries) {
  if (entries <= std::numeric_limits<int32_t>::max()) return ffi::Error::Success();
  return InvalidArgument(op, std::string(what) + " has " + std::to_string(entries) +
                                 " entries per batch element, more than int32 indices reach");
}

// plan_sends' `plan` attribute, a dictionary (moe_routing.py).
struct PlanSendsAttrs {
  int64_t num_experts = 0;  // E
  int64_t num_members = 0;  // N
  int64_t capacity = 0;     // C: pairs each member takes from this one
};

// place_received's `place` attribute, a dictionary (moe_routing.py).
struct PlaceReceivedAttrs {
  int64_t local_experts = 0;  // E_local
  int64_t capacity = 0;       // C
  int64_t top_k = 0;          // k
  int64_t suffix_offset = 0;  // where each received row's suffix starts, in bytes
  bool with_weights = false;  // the suffix carries the router weights after the tags
};

inline ffi::ErrorOr<PlanSendsShape> GetPlanSendsShape(const ffi::Buffer<ffi::S32>& expert_ids,
                                                      const std::optional<ffi::Buffer<ffi::F32>>& weights,
                                                      const PlanSendsAttrs& attrs) {
  constexpr std::string_view op = kPlanSendsOp;
  const int64_t num_experts = attrs.num_experts, num_members = attrs.num_members, capacity = attrs.capacity;
  const auto dims = expert_ids.dimensions();
  if (dims.size() != 3 || dims[2] < 1) {
    return InvalidArgument(op, "expert_ids has shape " + DimsString(dims) + ", expected [batch, tokens, k >= 1]");
  }
  if (weights.has_value()) {
    NCCLX_RETURN_IF_ERROR(CheckDims(op, "weights", weights->dimensions(), {dims[0], dims[1], dims[2]}));
  }
  if (num_members < 1 || num_experts < 1 || num_experts % num_members != 0 || num_experts > kMaxRoutingExperts) {
    return InvalidArgument(op, "num_experts " + std::to_string(num_experts) + " and num_members " +
                                   std::to_string(num_members) +
                                   ": expected num_experts a multiple of num_members, "
                                   "at most " +
                                   std::to_string(kMaxRoutingExperts));
  }
  if (capacity < 1 || capacity > kMaxCapacity) {
    return InvalidArgument(op, "capacity is " + std::to_string(capacity) + ", expected 1 to 2^31 - 1");
  }
  PlanSendsShape shape{dims[0], dims[1], dims[2], num_experts, num_members, capacity, weights.has_value()};
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "expert_ids", shape.num_pairs()));
  NCCLX_RETURN_IF_ERROR(
      CheckIndexable(op, "the (member, token, choice) table", num_members * shape.num_tokens * shape.top_k));
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "send_suffix", shape.num_rows() * shape.suffix_words()));
  NCCLX_RETURN_IF_ERROR(
      CheckIndexable(op, "the tag values", shape.rows_per_member() * shape.top_k * shape.local_experts()));
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "the return slots", num_members * capacity));
  return shape;
}

inline ffi::Error CheckPlanSendsResults(const PlanSendsShape& s, const Int32Result& order,
                                        const Int32Result& send_counts, const Int32Result& send_token,
                                        const Int32Result& send_suffix, const Int32Result& token_counts,
                                        const Int32Result& return_slot, const Int32Result& return_row,
                                        const Int32Result& dropped) {
  constexpr std::string_view op = kPlanSendsOp;
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "order", order->dimensions(), {s.batch, s.num_pairs()}));
  NCCLX_RETURN_IF_ERROR(
      CheckDims(op, "send_counts", send_counts->dimensions(), {s.batch, s.num_members, s.local_experts()}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "send_token", send_token->dimensions(), {s.batch, s.num_rows()}));
  NCCLX_RETURN_IF_ERROR(
      CheckDims(op, "send_suffix", send_suffix->dimensions(), {s.batch, s.num_rows(), s.suffix_words()}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "token_counts", token_counts->dimensions(), {s.batch, s.num_members}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "return_slot", return_slot->dimensions(), {s.batch, s.num_pairs()}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "return_row", return_row->dimensions(), {s.batch, s.num_tokens, s.num_members}));
  return CheckDims(op, "dropped", dropped->dimensions(), {s.batch, s.num_members});
}

// The buffers both handlers of plan_sends bind (after any context), and the attributes (after any scratch).
template <typename Binding>
auto BindPlanSendsBuffers(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()  // expert_ids [B, T, k]
      .template OptionalArg<ffi::Buffer<ffi::F32>>()    // weights [B, T, k]
      .template Ret<ffi::Buffer<ffi::S32>>()            // order [B, T * k]
      .template Ret<ffi::Buffer<ffi::S32>>()            // send_counts [B, N, E / N]
      .template Ret<ffi::Buffer<ffi::S32>>()            // send_token [B, S]
      .template Ret<ffi::Buffer<ffi::S32>>()            // send_suffix [B, S, SuffixWords]
      .template Ret<ffi::Buffer<ffi::S32>>()            // token_counts [B, N]
      .template Ret<ffi::Buffer<ffi::S32>>()            // return_slot [B, T * k]
      .template Ret<ffi::Buffer<ffi::S32>>()            // return_row [B, T, N]
      .template Ret<ffi::Buffer<ffi::S32>>();           // dropped [B, N]
}

template <typename Binding>
auto BindPlanSendsAttrs(Binding binding) {
  return std::move(binding).template Attr<PlanSendsAttrs>("plan");
}

inline PlanSendsResults PlanSendsData(const Int32Result& order, const Int32Result& send_counts,
                                      const Int32Result& send_token, const Int32Result& send_suffix,
                                      const Int32Result& token_counts, const Int32Result& return_slot,
                                      const Int32Result& return_row, const Int32Result& dropped) {
  return {order->typed_data(),        send_counts->typed_data(), send_token->typed_data(), send_suffix->typed_data(),
          token_counts->typed_data(), return_slot->typed_data(), return_row->typed_data(), dropped->typed_data()};
}

// rows: [B, N * R, ...] any dtype, each row's suffix at byte suffix_offset (SuffixWords(top_k, with_weights)).
inline ffi::ErrorOr<PlaceReceivedShape> GetPlaceReceivedShape(const ffi::AnyBuffer& rows,
                                                              const ffi::Buffer<ffi::S32>& recv_tokens,
                                                              const PlaceReceivedAttrs& attrs) {
  constexpr std::string_view op = kPlaceReceivedOp;
  const int64_t local_experts = attrs.local_experts, capacity = attrs.capacity, top_k = attrs.top_k;
  const int64_t suffix_offset = attrs.suffix_offset;
  const bool with_weights = attrs.with_weights;
  const auto token_dims = recv_tokens.dimensions();
  if (token_dims.size() != 2 || token_dims[1] < 1) {
    return InvalidArgument(op, "recv_tokens has shape " + DimsString(token_dims) + ", expected [batch, members]");
  }
  const auto row_dims = rows.dimensions();
  if (row_dims.size() < 2 || row_dims[0] != token_dims[0] || row_dims[1] % token_dims[1] != 0) {
    return InvalidArgument(op, "rows has shape " + DimsString(row_dims) + ", expected [" +
                                   std::to_string(token_dims[0]) + ", members * rows, ...] with " +
                                   std::to_string(token_dims[1]) + " members (recv_tokens)");
  }
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(op, "rows", rows.element_type()));
  int64_t row_bytes = static_cast<int64_t>(ffi::ByteWidth(rows.element_type()));
  for (size_t i = 2; i < row_dims.size(); ++i) row_bytes *= row_dims[i];
  // top_k and suffix_offset are bounded by the row before the suffix's size is computed from them.
  if (top_k < 1 || top_k > row_bytes || suffix_offset < 0 || suffix_offset > row_bytes ||
      suffix_offset + 4 * SuffixWords(top_k, with_weights) > row_bytes) {
    return InvalidArgument(op, "top_k " + std::to_string(top_k) + (with_weights ? " with" : " without") +
                                   " weights and suffix_offset " + std::to_string(suffix_offset) +
                                   ": expected top_k >= 1 and the suffix inside the rows' " +
                                   std::to_string(row_bytes) + " bytes");
  }
  if (local_experts < 1 || local_experts > kMaxRoutingExperts || token_dims[1] * local_experts > kMaxRoutingExperts ||
      capacity < 1 || capacity > kMaxCapacity) {
    return InvalidArgument(op, "local_experts " + std::to_string(local_experts) + " and capacity " +
                                   std::to_string(capacity) +
                                   ": expected both >= 1, capacity below 2^31 and "
                                   "members * local_experts at most " +
                                   std::to_string(kMaxRoutingExperts));
  }
  PlaceReceivedShape shape{token_dims[0], token_dims[1], row_dims[1] / token_dims[1],
                           top_k,         local_experts, capacity,
                           row_bytes,     suffix_offset, with_weights};
  // The kernel scans the tag counts twice and the rows once, in one int32 scan.
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "the tags (scanned as 2 * tags + rows)", (2 * top_k + 1) * row_dims[1]));
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "the tag values", shape.rows_per_source * shape.top_k * local_experts));
  NCCLX_RETURN_IF_ERROR(CheckIndexable(op, "the expert-major rows", shape.num_members * capacity));
  return shape;
}

inline ffi::Error CheckPlaceReceivedResults(const PlaceReceivedShape& s, const Int32Result& recv_counts,
                                            const Int32Result& group_sizes, const Int32Result& expand_rows,
                                            const Int32Result& to_expert_major, const Int32Result& to_source_major,
                                            const Int32Result& pair_entry, const Int32Result& row_pairs,
                                            const Int32Result& send_back_rows, const Float32Result& recv_weights) {
  constexpr std::string_view op = kPlaceReceivedOp;
  const int64_t rows = s.num_members * s.capacity;
  NCCLX_RETURN_IF_ERROR(
      CheckDims(op, "recv_counts", recv_counts->dimensions(), {s.batch, s.num_members, s.local_experts}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "group_sizes", group_sizes->dimensions(), {s.batch, s.local_experts}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "expand_rows", expand_rows->dimensions(), {s.batch, rows}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "to_expert_major", to_expert_major->dimensions(), {s.batch, rows}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "to_source_major", to_source_major->dimensions(), {s.batch, rows}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "pair_entry", pair_entry->dimensions(), {s.batch, rows}));
  const int64_t received = s.num_members * s.rows_per_source;
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "row_pairs", row_pairs->dimensions(), {s.batch, received, s.top_k}));
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "send_back_rows", send_back_rows->dimensions(), {s.batch, received}));
  return CheckDims(op, "recv_weights", recv_weights->dimensions(), {s.batch, received, s.with_weights ? s.top_k : 0});
}

// The buffers and attributes both handlers of place_received bind (after any context).
template <typename Binding>
auto BindPlaceReceived(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // rows [B, N * R, ...], with their suffixes
      .template Arg<ffi::Buffer<ffi::S32>>()            // recv_tokens [B, N]
      .template Ret<ffi::Buffer<ffi::S32>>()            // recv_counts [B, N, E_local]
      .template Ret<ffi::Buffer<ffi::S32>>()            // group_sizes [B, E_local]
      .template Ret<ffi::Buffer<ffi::S32>>()            // expand_rows [B, N * C]
      .template Ret<ffi::Buffer<ffi::S32>>()            // to_expert_major [B, N * C]
      .template Ret<ffi::Buffer<ffi::S32>>()            // to_source_major [B, N * C]
      .template Ret<ffi::Buffer<ffi::S32>>()            // pair_entry [B, N * C]
      .template Ret<ffi::Buffer<ffi::S32>>()            // row_pairs [B, N * R, k]
      .template Ret<ffi::Buffer<ffi::S32>>()            // send_back_rows [B, N * R]
      .template Ret<ffi::Buffer<ffi::F32>>()            // recv_weights [B, N * R, k or 0]
      .template Attr<PlaceReceivedAttrs>("place");
}

inline PlaceReceivedResults PlaceReceivedData(const Int32Result& recv_counts, const Int32Result& group_sizes,
                                              const Int32Result& expand_rows, const Int32Result& to_expert_major,
                                              const Int32Result& to_source_major, const Int32Result& pair_entry,
                                              const Int32Result& row_pairs, const Int32Result& send_back_rows,
                                              const Float32Result& recv_weights) {
  return {recv_counts->typed_data(),     group_sizes->typed_data(),     expand_rows->typed_data(),
          to_expert_major->typed_data(), to_source_major->typed_data(), pair_entry->typed_data(),
          row_pairs->typed_data(),       send_back_rows->typed_data(),  recv_weights->typed_data()};
}

}  // namespace jax_ncclx

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::PlanSendsAttrs, ::xla::ffi::StructMember<int64_t>("num_experts"),
                                      ::xla::ffi::StructMember<int64_t>("num_members"),
                                      ::xla::ffi::StructMember<int64_t>("capacity"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::PlaceReceivedAttrs, ::xla::ffi::StructMember<int64_t>("local_experts"),
                                      ::xla::ffi::StructMember<int64_t>("capacity"),
                                      ::xla::ffi::StructMember<int64_t>("top_k"),
                                      ::xla::ffi::StructMember<int64_t>("suffix_offset"),
                                      ::xla::ffi::StructMember<bool>("with_weights"));
