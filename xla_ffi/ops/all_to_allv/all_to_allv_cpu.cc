// CPU handlers of all_to_allv_dynamic and of ragged_all_to_all's exchange. Every participant plans its own
// sends (PlanSends, the same code the CUDA kernels run), reports its dropped rows, publishes its input,
// send_rows, suffix and plan, and then pulls from every source the prefix of rows that source planned for it,
// in the padded or packed receive layout, or (ragged_all_to_all) onto the rows of its output that its place
// table names.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/all_to_allv_plan.h"
#include "common/checks.h"
#include "ops/all_to_allv/all_to_allv_checks.h"
#include "common/cpu_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

// One participant's send plan for all batch elements, laid out [batch][peer] ([batch][peer][chunk]), its
// send_rows (null: x's rows in order) and its suffix (null: none).
struct SendPlan {
  const int32_t* send_rows = nullptr;
  const char* suffix = nullptr;
  std::vector<int32_t> delivered_chunks;
  std::vector<int64_t> first_row;
  std::vector<int64_t> delivered;
};

std::vector<int32_t> CorruptCounts(const int32_t* counts, int64_t n) {
  std::vector<int32_t> out(counts, counts + n);
  for (int64_t i = 0; i < n; ++i) out[i] = CorruptedCount(out[i], i);
  return out;
}

// Returns a pending future while its peers have not all arrived (common/rendezvous.h); the work it passes
// owns its plan and captures buffer pointers by value, as it may run after the handler has returned.
ffi::Future AllToAllvImpl(std::string_view op, ffi::RunId run, CallInstance* instance, PartitionId partition_id,
                          ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                          std::optional<ffi::Buffer<ffi::S32>> send_rows, std::optional<ffi::AnyBuffer> suffix,
                          std::optional<ffi::Buffer<ffi::S32>> place, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::Buffer<ffi::S32>> recv_counts, ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                          ffi::Span<const int64_t> groups, int64_t group_size, RawCallAttrs call_attrs,
                          ExchangeAttrs exchange) {
  const int64_t capacity = exchange.capacity;
  const bool packed = exchange.packed;
  ffi::ErrorOr<AllToAllvSendRows> sent = GetSendRows(op, x, send_rows, suffix);
  if (sent.has_error()) return CompletedFuture(sent.error());
  ffi::ErrorOr<int64_t> chunks = CheckReceiveSide(op, *sent, x, counts.dimensions(), *y, recv_counts->dimensions(),
                                                  dropped->dimensions(), group_size, capacity, place.has_value());
  if (chunks.has_error()) return CompletedFuture(chunks.error());
  int64_t out_rows = 0;  // placed: O, y's rows per batch element
  if (place.has_value()) {
    ffi::ErrorOr<int64_t> rows = CheckPlace(op, *sent, place->dimensions(), *y, group_size, capacity);
    if (rows.has_error()) return CompletedFuture(rows.error());
    out_rows = *rows;
  }
  const int32_t* slots = OptionalData(place);  // placed: y keeps its rows (its output operand's), no zeroing
  const int64_t num_batch = sent->batch, num_peers = group_size, num_chunks = *chunks;
  const int64_t source_rows = sent->source_rows, num_rows = sent->num_rows;
  const int64_t row_bytes = sent->row_bytes, suffix_bytes = sent->suffix_bytes;
  const int64_t x_row_bytes = row_bytes - suffix_bytes;

  ffi::ErrorOr<CpuCall> call = BeginCpuCall(op, run, instance, partition_id.typed_data()[0], groups, group_size,
                                            call_attrs);
  if (call.has_error()) return CompletedFuture(call.error());
  const int32_t* send_counts = counts.typed_data();
  std::vector<int32_t> corrupted;
  if (call->fault && call->fault->kind == FaultKind::kCorruptCounts) {
    corrupted = CorruptCounts(send_counts, counts.element_count());
    send_counts = corrupted.data();
  }
  auto plan = std::make_shared<SendPlan>(
      SendPlan{OptionalData(send_rows), static_cast<const char*>(OptionalData(suffix)),
               std::vector<int32_t>(num_batch * num_peers * num_chunks), std::vector<int64_t>(num_batch * num_peers),
               std::vector<int64_t>(num_batch * num_peers)});
  for (int64_t b = 0; b < num_batch; ++b) {
    PlanSends(send_counts + b * num_peers * num_chunks, num_peers, num_chunks, num_rows, capacity,
              plan->delivered_chunks.data() + b * num_peers * num_chunks, plan->first_row.data() + b * num_peers,
              plan->delivered.data() + b * num_peers, dropped->typed_data() + b * num_peers);
  }

  char* out = static_cast<char*>(y->untyped_data());
  const size_t out_bytes = y->size_bytes();
  int32_t* received = recv_counts->typed_data();
  return RunCpuCall(
      *call, {x.untyped_data(), plan.get()}, out, out_bytes, [=](int64_t rank, const std::vector<Published>& peers) {
        (void)plan;  // owned here: the peers read it until every participant's work has run
        if (slots == nullptr) std::memset(out, 0, out_bytes);
        for (int64_t b = 0; b < num_batch; ++b) {
          int64_t packed_row = 0;  // next free row of this batch element in the packed layout
          for (int64_t source = 0; source < num_peers; ++source) {
            const SendPlan& theirs = *static_cast<const SendPlan*>(peers[source].extra);
            const int64_t slot = b * num_peers + rank;  // their plan entry for me
            std::copy_n(theirs.delivered_chunks.data() + slot * num_chunks, num_chunks,
                        received + (b * num_peers + source) * num_chunks);
            const int64_t rows = theirs.delivered[slot];
            if (slots != nullptr) {  // placed: row r lands on row slots[b, source * C + r], where that is in y
              const int32_t* where = slots + (b * num_peers + source) * capacity;
              const char* x_rows = static_cast<const char*>(peers[source].data);
              for (int64_t r = 0; r < rows; ++r) {
                if (where[r] < 0 || where[r] >= out_rows) continue;
                const int64_t send_row = theirs.first_row[slot] + r;
                const int64_t row = SourceRow(theirs.send_rows, num_rows, source_rows, b, send_row);
                char* out_row = out + (b * out_rows + where[r]) * row_bytes;
                if (row >= 0) {
                  std::memcpy(out_row, x_rows + row * x_row_bytes, x_row_bytes);
                } else {
                  std::memset(out_row, 0, x_row_bytes);
                }
              }
              continue;
            }
            const int64_t dst_row = packed ? packed_row : source * capacity;
            char* dst = out + (b * num_peers * capacity + dst_row) * row_bytes;
            const char* x_rows = static_cast<const char*>(peers[source].data);
            if (theirs.send_rows == nullptr && theirs.suffix == nullptr) {  // the rows are contiguous in x: one copy
              const int64_t first = SourceRow(nullptr, num_rows, source_rows, b, theirs.first_row[slot]);
              if (rows > 0) std::memcpy(dst, x_rows + first * row_bytes, rows * row_bytes);
            } else {
              for (int64_t r = 0; r < rows; ++r) {  // y starts zeroed: rows outside x stay zero
                const int64_t send_row = theirs.first_row[slot] + r;
                const int64_t row = SourceRow(theirs.send_rows, num_rows, source_rows, b, send_row);
                char* out_row = dst + r * row_bytes;
                if (row >= 0) std::memcpy(out_row, x_rows + row * x_row_bytes, x_row_bytes);
                if (theirs.suffix != nullptr) {
                  std::memcpy(out_row + x_row_bytes, theirs.suffix + (b * num_rows + send_row) * suffix_bytes,
                              suffix_bytes);
                }
              }
            }
            packed_row += rows;
          }
        }
        return ffi::Error::Success();
      });
}

ffi::Future AllToAllvDynamicImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> counts, std::optional<ffi::Buffer<ffi::S32>> send_rows,
                                 std::optional<ffi::AnyBuffer> suffix, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                                 ffi::Result<ffi::Buffer<ffi::S32>> dropped, ffi::Span<const int64_t> groups,
                                 int64_t group_size, RawCallAttrs call_attrs, ExchangeAttrs exchange) {
  return AllToAllvImpl(kAllToAllvOp, run, instance, partition_id, x, counts, send_rows, suffix, std::nullopt, y,
                       recv_counts, dropped, groups, group_size, call_attrs, exchange);
}

// `output` is y's buffer (XLA aliases them): the rows that nothing places keep its values.
ffi::Future RaggedAllToAllImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> send_rows,
                               ffi::Buffer<ffi::S32> place, ffi::AnyBuffer /*output*/, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                               ffi::Result<ffi::Buffer<ffi::S32>> dropped, ffi::Span<const int64_t> groups,
                               int64_t group_size, RawCallAttrs call_attrs, int64_t capacity) {
  return AllToAllvImpl(kRaggedAllToAllOp, run, instance, partition_id, x, counts, send_rows, std::nullopt, place, y,
                       recv_counts, dropped, groups, group_size, call_attrs, ExchangeAttrs{capacity, /*packed=*/false});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuRaggedAllToAll, RaggedAllToAllImpl,
                              BindCpuGroupAttrs(BindCpuCollective()
                                                    .Arg<ffi::AnyBuffer>()          // x [B, X, ...]
                                                    .Arg<ffi::Buffer<ffi::S32>>()   // send_counts [B, N, K]
                                                    .Arg<ffi::Buffer<ffi::S32>>()   // send_rows [B, S]
                                                    .Arg<ffi::Buffer<ffi::S32>>()   // place [B, N * C]
                                                    .Arg<ffi::AnyBuffer>()          // output [B, O, ...] (= y)
                                                    .Ret<ffi::AnyBuffer>()          // y [B, O, ...]
                                                    .Ret<ffi::Buffer<ffi::S32>>()   // recv_counts [B, N, K]
                                                    .Ret<ffi::Buffer<ffi::S32>>())  // dropped [B, N]
                                  .Attr<int64_t>("capacity"));                      // max rows per source

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllToAllvDynamic, AllToAllvDynamicImpl,
                              BindCpuGroupAttrs(BindCpuCollective()
                                                    .Arg<ffi::AnyBuffer>()          // x [B, X, ...]
                                                    .Arg<ffi::Buffer<ffi::S32>>()   // send_counts [B, N, K]
                                                    .OptionalArg<ffi::Buffer<ffi::S32>>()  // send_rows [B, S]
                                                    .OptionalArg<ffi::AnyBuffer>()  // suffix [B, S, G]
                                                    .Ret<ffi::AnyBuffer>()          // y (padded or packed)
                                                    .Ret<ffi::Buffer<ffi::S32>>()   // recv_counts [B, N, K]
                                                    .Ret<ffi::Buffer<ffi::S32>>())  // dropped [B, N]
                                  .Attr<ExchangeAttrs>("exchange"));

}  // namespace jax_ncclx
