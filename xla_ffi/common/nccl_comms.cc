// The communicator registry and the CUDA/NCCL helpers declared in nccl_comms.h.
#include "common/nccl_comms.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>

namespace jax_ncclx {

// How a rank's communicator stands. kAbortPending / kRevokePending: AbortComm came while a handler held a lease;
// the last lease to end carries the stop out.
enum class SlotState { kLive, kAbortPending, kRevokePending, kAborted, kRevoked };

struct NcclSlot {
  ncclComm_t comm = nullptr;
  int64_t init_bytes = 0;
  std::mutex mu;  // guards the two below; taken inside the registry's lock, never around it
  int leases = 0;
  SlotState state = SlotState::kLive;
};

namespace {

struct Registry {
  std::shared_mutex mu;  // handlers only read (shared); the module registers and destroys (exclusive)
  int64_t next_id = 1;
  std::map<int64_t, std::map<int32_t, CommMember>> members;
  // Only communicators that NCCL ops needed. Slots stay until DestroyAllComms, aborted ones too; a lease keeps
  // its slot alive past that.
  std::map<int64_t, std::map<int32_t, std::shared_ptr<NcclSlot>>> comms;
  std::map<int64_t, std::string> faults;  // communicators that stopped working, with why
  std::set<int64_t> captured;  // communicators with NCCL calls in CUDA graphs, which may be replayed any time
  std::atomic<bool> any_fault{false};
};

// Carries out a stop that AbortComm decided (kAborted / kRevoked). Best effort: the communicator is lost either
// way.
void StopNccl(ncclComm_t comm, SlotState stop) {
  if (stop == SlotState::kRevoked) {
    ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
  } else {
    ncclCommAbort(comm);
  }
}

Registry& GetRegistry() {
  // Never destroyed: communicators left at exit are torn down by the process, not by a static destructor
  // that may run after the CUDA runtime is gone.
  static Registry* registry = new Registry();
  return *registry;
}

}  // namespace

int64_t RegisterComm(std::map<int32_t, CommMember> members) {
  Registry& registry = GetRegistry();
  std::unique_lock<std::shared_mutex> lock(registry.mu);
  const int64_t comm_id = registry.next_id++;
  registry.members.emplace(comm_id, std::move(members));
  return comm_id;
}

ffi::Error AttachNcclComms(std::string_view op, int64_t comm_id, std::map<int32_t, NcclRank> comms) {
  std::map<int32_t, std::shared_ptr<NcclSlot>> slots;
  for (const auto& [device, nccl] : comms) {
    auto slot = std::make_shared<NcclSlot>();
    slot->comm = nccl.comm;
    slot->init_bytes = nccl.init_bytes;
    slots.emplace(device, std::move(slot));
  }
  Registry& registry = GetRegistry();
  std::unique_lock<std::shared_mutex> lock(registry.mu);
  if (!registry.members.count(comm_id)) {
    return InvalidArgument(op, "no communicator " + std::to_string(comm_id) + " (unknown or destroyed)");
  }
  if (!registry.comms.emplace(comm_id, std::move(slots)).second) {
    return InvalidArgument(op, "communicator " + std::to_string(comm_id) + " already has NCCL communicators");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::map<int32_t, CommMember>> CommMembers(std::string_view op, int64_t comm_id) {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  const auto it = registry.members.find(comm_id);
  if (it == registry.members.end()) {
    return InvalidArgument(op, "no communicator " + std::to_string(comm_id) + " (unknown or destroyed)");
  }
  return it->second;
}

std::vector<std::pair<int64_t, int32_t>> RegisteredMembers() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  std::vector<std::pair<int64_t, int32_t>> all;
  for (const auto& [comm_id, by_device] : registry.members) {
    for (const auto& [device, member] : by_device) all.emplace_back(comm_id, device);
  }
  return all;
}

std::vector<std::tuple<int64_t, int32_t, int64_t>> CommInitBytes() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  std::vector<std::tuple<int64_t, int32_t, int64_t>> all;
  for (const auto& [comm_id, by_device] : registry.comms) {
    for (const auto& [device, slot] : by_device) {
      std::lock_guard<std::mutex> slot_lock(slot->mu);
      if (slot->state != SlotState::kAborted) all.emplace_back(comm_id, device, slot->init_bytes);
    }
  }
  return all;
}

void RecordCommFault(int64_t comm_id, std::string message) {
  Registry& registry = GetRegistry();
  std::unique_lock<std::shared_mutex> lock(registry.mu);
  if (registry.faults.emplace(comm_id, message).second) {
    std::fprintf(stderr, "jax_ncclx: %s\n", message.c_str());  // at once, even if no later call reports it
  }
  registry.any_fault.store(true, std::memory_order_relaxed);
}

std::string CommFaultOf(int64_t comm_id) {
  Registry& registry = GetRegistry();
  if (!registry.any_fault.load(std::memory_order_relaxed)) return "";
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  const auto it = registry.faults.find(comm_id);
  return it == registry.faults.end() ? "" : it->second;
}

ffi::Error UnusableCommError(std::string_view op, int64_t comm_id, std::string_view fault) {
  return DeadlineExceeded(op, "communicator " + std::to_string(comm_id) + " is unusable: " + std::string(fault));
}

ffi::Error CheckCommUsable(std::string_view op, int64_t comm_id) {
  const std::string fault = CommFaultOf(comm_id);
  return fault.empty() ? ffi::Error::Success() : UnusableCommError(op, comm_id, fault);
}

std::vector<std::pair<int64_t, std::string>> CommFaults() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  return {registry.faults.begin(), registry.faults.end()};
}

std::vector<std::pair<int64_t, std::string>> CommAsyncErrors() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);  // destroy unregisters (exclusively) before freeing
  std::vector<std::pair<int64_t, std::string>> failed;
  for (const auto& [comm_id, by_device] : registry.comms) {
    for (const auto& [device, slot] : by_device) {
      // Only live ranks: a stopped or stopping one belongs to a communicator whose fault is recorded already.
      std::lock_guard<std::mutex> slot_lock(slot->mu);
      if (slot->state != SlotState::kLive) break;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(slot->comm, &async) != ncclSuccess || async == ncclSuccess || async == ncclInProgress) {
        continue;
      }
      std::string why = ncclGetErrorString(async);
      const char* last = ncclGetLastError(slot->comm);
      if (last != nullptr && *last != '\0') why += std::string(" (") + last + ")";
      failed.emplace_back(comm_id, std::move(why));
      break;
    }
  }
  return failed;
}

void ClearCommFaults() {
  Registry& registry = GetRegistry();
  std::unique_lock<std::shared_mutex> lock(registry.mu);
  registry.faults.clear();
  registry.any_fault.store(false, std::memory_order_relaxed);
}

void MarkCommCaptured(int64_t comm_id) {
  Registry& registry = GetRegistry();
  {
    std::shared_lock<std::shared_mutex> lock(registry.mu);
    if (registry.captured.count(comm_id)) return;
  }
  std::unique_lock<std::shared_mutex> lock(registry.mu);
  registry.captured.insert(comm_id);
}

void AbortComm(int64_t comm_id, std::string message) {
  RecordCommFault(comm_id, std::move(message));
  std::vector<std::pair<ncclComm_t, SlotState>> stop_now;
  {
    Registry& registry = GetRegistry();
    std::shared_lock<std::shared_mutex> lock(registry.mu);  // the maps stay as they are; the slots change
    const auto it = registry.comms.find(comm_id);
    if (it == registry.comms.end()) return;
    // Graphs may replay a captured communicator's kernels later: they must find its resources.
    const bool revoke = registry.captured.count(comm_id) > 0;
    for (const auto& [device, slot] : it->second) {
      std::lock_guard<std::mutex> slot_lock(slot->mu);
      if (slot->state != SlotState::kLive) continue;  // stopped, or stopping, already
      if (slot->leases > 0) {
        slot->state = revoke ? SlotState::kRevokePending : SlotState::kAbortPending;
      } else {
        slot->state = revoke ? SlotState::kRevoked : SlotState::kAborted;
        stop_now.emplace_back(slot->comm, slot->state);
      }
    }
  }
  for (const auto& [comm, stop] : stop_now) StopNccl(comm, stop);
}

CommLease::~CommLease() {
  if (slot_ == nullptr) return;
  SlotState stop = SlotState::kLive;
  {
    std::lock_guard<std::mutex> lock(slot_->mu);
    if (--slot_->leases > 0) return;
    if (slot_->state == SlotState::kAbortPending) stop = slot_->state = SlotState::kAborted;
    if (slot_->state == SlotState::kRevokePending) stop = slot_->state = SlotState::kRevoked;
  }
  if (stop != SlotState::kLive) StopNccl(slot_->comm, stop);  // the last handler out stops it
}

ffi::ErrorOr<CommRank> LookupCommRank(std::string_view op, int64_t comm_id, int32_t device_ordinal) {
  NCCLX_RETURN_IF_ERROR(CheckCommUsable(op, comm_id));
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  const auto comms = registry.comms.find(comm_id);
  const auto members = registry.members.find(comm_id);
  if (comms != registry.comms.end() && members != registry.members.end()) {
    const auto slot = comms->second.find(device_ordinal);
    const auto member = members->second.find(device_ordinal);
    if (slot != comms->second.end() && member != members->second.end()) {
      {
        std::lock_guard<std::mutex> slot_lock(slot->second->mu);
        // AbortComm records the fault before it stops a rank, so a rank found stopping here has one.
        if (slot->second->state == SlotState::kLive) {
          ++slot->second->leases;
          return CommRank{member->second, slot->second->comm, CommLease(slot->second)};
        }
      }
      const auto fault = registry.faults.find(comm_id);
      return UnusableCommError(op, comm_id, fault == registry.faults.end() ? "it was aborted" : fault->second);
    }
  }
  if (members != registry.members.end() && comms == registry.comms.end()) {
    return Internal(op, "communicator " + std::to_string(comm_id) +
                            " has no NCCL communicators: jax_ncclx "
                            "creates them when it compiles an op that goes through NCCL, and did not for this one");
  }
  return InvalidArgument(op, "no communicator " + std::to_string(comm_id) + " for device " +
                                 std::to_string(device_ordinal) +
                                 "; was jax_ncclx shut down after this program was compiled?");
}

ffi::Error DestroyAllComms(std::string_view op) {
  std::map<int64_t, std::map<int32_t, std::shared_ptr<NcclSlot>>> doomed;
  {
    // Unregister first so that no handler can look a communicator up while it is being destroyed.
    Registry& registry = GetRegistry();
    std::unique_lock<std::shared_mutex> lock(registry.mu);
    doomed.swap(registry.comms);
    registry.members.clear();
    registry.captured.clear();
  }
  if (doomed.empty()) return ffi::Error::Success();
  // ncclCommDestroy does not wait for the other ranks (the last local rank frees shared resources), so one
  // thread can destroy every local communicator in turn.
  return KeepingCurrentDevice(op, [&] {
    ffi::Error first_failure;
    for (const auto& [comm_id, by_device] : doomed) {
      for (const auto& [device, slot] : by_device) {
        SlotState state = SlotState::kLive;
        {
          std::lock_guard<std::mutex> slot_lock(slot->mu);
          state = slot->state;
          slot->state = SlotState::kAborted;  // a lease still held (a program still running) stops nothing more
        }
        if (state == SlotState::kAborted) continue;  // freed already
        // A revoked (or stopping) communicator cannot be finalized: abort frees it without.
        ffi::Error destroyed = state == SlotState::kLive
                                   ? CheckNccl(op, "ncclCommDestroy", ncclCommDestroy(slot->comm), slot->comm)
                                   : CheckNccl(op, "ncclCommAbort", ncclCommAbort(slot->comm), slot->comm);
        if (destroyed.failure() && first_failure.success()) first_failure = std::move(destroyed);
      }
    }
    return first_failure;
  });
}

ffi::Error CheckNccl(std::string_view op, std::string_view call, ncclResult_t result, ncclComm_t comm) {
  if (result == ncclSuccess) return ffi::Error::Success();
  std::string message = std::string(call) + " failed: " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') message += " (" + std::string(last) + ")";
  return Internal(op, message);
}

ffi::Error CheckCuda(std::string_view op, std::string_view call, cudaError_t result) {
  if (result == cudaSuccess) return ffi::Error::Success();
  return Internal(op, std::string(call) + " failed: " + cudaGetErrorName(result) + ": " + cudaGetErrorString(result));
}

ffi::ErrorOr<ncclDataType_t> NcclReductionType(std::string_view op, ffi::DataType dtype) {
  switch (dtype) {
    case ffi::F32:
      return ncclFloat32;
    case ffi::F64:
      return ncclFloat64;
    case ffi::F16:
      return ncclFloat16;
    case ffi::BF16:
      return ncclBfloat16;
    case ffi::S8:
      return ncclInt8;
    case ffi::U8:
      return ncclUint8;
    case ffi::S32:
      return ncclInt32;
    case ffi::U32:
      return ncclUint32;
    case ffi::S64:
      return ncclInt64;
    case ffi::U64:
      return ncclUint64;
    default:
      return InvalidArgument(op, "cannot reduce dtype " + std::string(DataTypeName(dtype)) +
                                     "; supported: f32, f64, f16, bf16, s8, u8, s32, u32, s64, u64");
  }
}

ncclRedOp_t NcclReduceOp(ReduceOp reduce) {
  switch (reduce) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;  // not reached: GetReducedDtype decodes only the three
}

}  // namespace jax_ncclx
