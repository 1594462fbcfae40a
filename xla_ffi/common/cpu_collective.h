// What every CPU collective handler shares: the replica-group and call attributes the Python lowering passes
// to each CPU custom call, and the call that turns them into a rendezvous with the right peers, with the
// sequence numbers, injected faults and trace records of monitor.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/contract_attrs.h"
#include "common/checks.h"
#include "common/groups.h"
#include "common/monitor.h"
#include "common/rendezvous.h"

namespace jax_ncclx {

// The partition id, a scalar operand the Python lowering passes first (the binding refuses any other rank).
using PartitionId = ffi::BufferR0<ffi::U32>;

// One custom call of a compiled program, made by XLA when it instantiates the executable, once per
// instruction and shared by every device that runs it. Its key tells apart the copies of one call site that
// XLA makes when it inlines a jitted function called from several places: they carry the same `site`
// attribute, and devices may reach them in different orders.
struct CallInstance {
  static ffi::TypeId id;
  int64_t key;
};

// Starts the binding of a CPU collective with what every one takes first: the logical execution's run id
// (the same on every device of one execution of the program), the call's instance and the partition id.
inline auto BindCpuCollective() {
  return ffi::Ffi::Bind().Ctx<ffi::RunId>().Ctx<ffi::State<CallInstance>>().Arg<PartitionId>();
}

// Appends the attributes every CPU collective takes, in the order the handlers' parameters after the
// buffers expect: groups, group_size, call_attrs.
template <typename Binding>
auto BindCpuGroupAttrs(Binding binding) {
  return BindCallAttrs(std::move(binding)
                           .template Attr<ffi::Span<const int64_t>>("groups")  // flat partition ids of all groups
                           .template Attr<int64_t>("group_size"));            // participants per group
}

// One participant's call, from BeginCpuCall to RunCpuCall.
struct CpuCall {
  std::string_view op;
  CallAttrs attrs;
  GroupPosition position;
  uint32_t partition_id = 0;
  int64_t group_size = 0;
  int64_t comm = 0;  // key of the replica group, for sequence numbers
  int64_t sequence = 0;
  RoundKey round;    // where the participants meet, taken before a fault may skip the call
  std::optional<InjectedFault> fault;
};

// Hash of the replica groups and the group index: the CPU stand-in for a communicator id.
inline int64_t CpuCommKey(ffi::Span<const int64_t> groups, int64_t group_idx) {
  uint64_t hash = 1469598103934665603ull;
  for (const int64_t id : groups) hash = (hash ^ static_cast<uint64_t>(id)) * 1099511628211ull;
  hash = (hash ^ static_cast<uint64_t>(group_idx)) * 1099511628211ull;
  return static_cast<int64_t>(hash >> 1);
}

inline ffi::ErrorOr<CpuCall> BeginCpuCall(std::string_view op, ffi::RunId run, const CallInstance* instance,
                                          uint32_t partition_id, ffi::Span<const int64_t> groups, int64_t group_size,
                                          RawCallAttrs call_attrs) {
  ffi::ErrorOr<GroupPosition> position = FindGroupPosition(op, groups, group_size, partition_id);
  if (position.has_error()) return position.error();
  CpuCall call;
  call.op = op;
  call.attrs = MakeCallAttrs(call_attrs);
  call.position = *position;
  call.partition_id = partition_id;
  call.group_size = group_size;
  call.comm = CpuCommKey(groups, position->group_idx);
  call.sequence = NextSequence(call.comm, static_cast<int>(position->rank));
  call.fault = InjectedFaultFor(static_cast<int>(position->rank), call.sequence);
  call.round = RoundKey{instance->key, position->group_idx, run.run_id,
                        RendezvousSequence(instance->key, partition_id, run.run_id)};
  return call;
}

// One participant's work: writes its outputs from its rank and every participant's published pointers. It
// runs after the handler has returned (rendezvous.h), so it owns what it captures.
using CpuWork = std::function<ffi::Error(int64_t rank, const std::vector<Published>& peers)>;

// Joins the collective as the participant `call` describes, whose `work` writes `output` (`output_bytes`).
// Injected faults: a delayed call sleeps first, a skipped one returns at once (its peers time out), a
// corrupted payload has one byte of the output flipped afterwards.
inline ffi::Future RunCpuCall(const CpuCall& call, Published mine, void* output, size_t output_bytes, CpuWork work) {
  CallRecord record;
  int64_t record_index = -1;
  if (call.attrs.trace) {
    record.site = call.attrs.site;
    record.comm = call.comm;
    record.group = call.position.group_idx;
    record.sequence = call.sequence;
    record.rank = static_cast<int32_t>(call.position.rank);
    record.device = static_cast<int32_t>(call.partition_id);
    record.enqueue_ns = NowNs();
    record.injected = call.fault ? static_cast<int32_t>(call.fault->kind) : -1;
    AppendCallRecord(record, &record_index);
  }
  if (ApplyDelayOrSkip(call.fault, /*stall_on_host=*/true)) return CompletedFuture(ffi::Error::Success());
  if (call.attrs.trace) {
    record.start_ns = NowNs();
    UpdateCallRecord(record_index, record);
  }
  const int64_t rank = call.position.rank;
  const bool corrupt = call.fault && call.fault->kind == FaultKind::kCorruptPayload && output_bytes >= 4;
  const bool trace = call.attrs.trace;
  std::string what = "call #" + std::to_string(call.sequence) + " (" + DescribeCallSite(call.attrs.site) +
                     ", replica group " + std::to_string(call.position.group_idx) + ")";
  return JoinCollective(call.op, std::move(what), call.round, rank, call.group_size, mine,
                        std::chrono::milliseconds(call.attrs.timeout_ms), std::chrono::milliseconds(call.attrs.warn_ms),
                        [=, work = std::move(work)](const std::vector<Published>& peers) mutable {
                          if (peers.empty()) {  // the round failed: the call ends without its peers
                            if (trace) {
                              record.end_ns = NowNs();
                              UpdateCallRecord(record_index, record);
                            }
                            return ffi::Error::Success();
                          }
                          if (trace) record.arrive_ns = NowNs();
                          ffi::Error result = work(rank, peers);
                          if (result.success() && corrupt) {  // as the GPU's
                            std::memset(static_cast<unsigned char*>(output) + (output_bytes / 2) / 4 * 4, 0xA5, 4);
                          }
                          if (trace) {
                            record.end_ns = NowNs();
                            UpdateCallRecord(record_index, record);
                          }
                          return result;
                        });
}

// BeginCpuCall then RunCpuCall, for handlers that need nothing in between.
inline ffi::Future RunInGroup(std::string_view op, ffi::RunId run, const CallInstance* instance, uint32_t partition_id,
                              ffi::Span<const int64_t> groups, int64_t group_size, RawCallAttrs call_attrs,
                              Published mine, void* output, size_t output_bytes, CpuWork work) {
  ffi::ErrorOr<CpuCall> call = BeginCpuCall(op, run, instance, partition_id, groups, group_size, call_attrs);
  if (call.has_error()) return CompletedFuture(call.error());
  return RunCpuCall(*call, mine, output, output_bytes, std::move(work));
}

// Returns a failed future from a handler that returns ffi::Future when `expr` is an error.
#define NCCLX_RETURN_FUTURE_IF_ERROR(expr)                                                    \
  do {                                                                                        \
    ::xla::ffi::Error ncclx_error_ = (expr);                                                  \
    if (ncclx_error_.failure()) return ::jax_ncclx::CompletedFuture(std::move(ncclx_error_)); \
  } while (0)

}  // namespace jax_ncclx
