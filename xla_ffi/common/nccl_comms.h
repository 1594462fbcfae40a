// The process-wide registry of the NCCL communicators that the CUDA handlers use, plus the small CUDA/NCCL
// helpers those handlers share: error conversion, dtype and reduction mapping, group calls.
//
// The Python side registers communicators (through the _ncclx_cuda module) before any program that uses them
// runs. Each gets a new comm_id with its local ranks, and, once an op that goes through NCCL is compiled, one
// ncclComm_t per local CUDA device ordinal; the handlers, one host thread per device, look theirs up by
// (comm_id, device ordinal).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"

namespace jax_ncclx {

// A local rank of a communicator, known from the mesh before NCCL is involved.
struct CommMember {
  int rank = -1;
  int size = 0;
};

// That rank's NCCL communicator, with the device bytes its creation took (nx.memory_stats).
struct NcclRank {
  ncclComm_t comm = nullptr;
  int64_t init_bytes = 0;
};

// One local rank's NCCL communicator in the registry, with its in-flight handlers (nccl_comms.cc).
struct NcclSlot;
struct CommRank;

// Held by a handler from looking its communicator up until it has queued its work: while any lease on a rank
// is held, AbortComm defers that rank's ncclCommAbort (or ncclCommRevoke) to the end of the last lease, so NCCL
// never frees or revokes a communicator that a handler thread is launching on. Move-only; only LookupCommRank
// makes one, counting it under the slot's lock, and the destructor uncounts it.
class CommLease {
 public:
  CommLease() = default;
  CommLease(CommLease&&) noexcept = default;
  CommLease(const CommLease&) = delete;
  CommLease& operator=(const CommLease&) = delete;
  CommLease& operator=(CommLease&&) = delete;
  ~CommLease();

 private:
  explicit CommLease(std::shared_ptr<NcclSlot> slot) : slot_(std::move(slot)) {}
  friend ffi::ErrorOr<CommRank> LookupCommRank(std::string_view op, int64_t comm_id, int32_t device_ordinal);

  std::shared_ptr<NcclSlot> slot_;
};

// What a handler needs to call NCCL: the local rank and its communicator, leased for as long as this lives.
struct CommRank : CommMember {
  ncclComm_t comm = nullptr;
  CommLease lease;
};

// Registers a communicator's local ranks (device ordinal -> rank and size; may be empty) under a new comm_id
// and returns it. Ids start at 1 and are never reused. The NCCL communicators come later, if ever
// (AttachNcclComms): jax_ncclx creates them when it compiles the first op that goes through NCCL, so a
// communicator used only by the NVLink kernels never holds NCCL's memory.
int64_t RegisterComm(std::map<int32_t, CommMember> members);

// Gives `comm_id` its NCCL communicators, one per local member, by device ordinal. The registry owns them
// from then on.
ffi::Error AttachNcclComms(std::string_view op, int64_t comm_id, std::map<int32_t, NcclRank> comms);

// The local members of `comm_id`, by device ordinal.
ffi::ErrorOr<std::map<int32_t, CommMember>> CommMembers(std::string_view op, int64_t comm_id);

// (comm_id, device ordinal) of every local member of every registered communicator.
std::vector<std::pair<int64_t, int32_t>> RegisteredMembers();

// (comm_id, device ordinal, device bytes its creation took) of every NCCL communicator that holds them: not
// those aborted (freed), but those revoked or waiting for a lease to end before their abort.
std::vector<std::tuple<int64_t, int32_t, int64_t>> CommInitBytes();

// The NCCL communicator that `comm_id` holds for `device_ordinal`, with that rank and the size (from the
// registry: no NCCL call on the handlers' path), leased to the caller (CommLease). Fails with the recorded
// fault once the communicator is unusable.
ffi::ErrorOr<CommRank> LookupCommRank(std::string_view op, int64_t comm_id, int32_t device_ordinal);

// ---- faults: communicators that stopped working ----------------------------------------------------------

// Marks `comm_id` unusable with `message` (the first message wins). Later lookups of it fail with
// DeadlineExceeded carrying the message.
void RecordCommFault(int64_t comm_id, std::string message);

// The recorded fault of `comm_id`, or "" when it has none. One relaxed load when no communicator has failed.
std::string CommFaultOf(int64_t comm_id);

// Success while `comm_id` has no recorded fault, else DeadlineExceeded saying it is unusable and why.
ffi::Error CheckCommUsable(std::string_view op, int64_t comm_id);
ffi::Error UnusableCommError(std::string_view op, int64_t comm_id, std::string_view fault);

// Every recorded fault, as (comm_id, message).
std::vector<std::pair<int64_t, std::string>> CommFaults();

// The registered communicators whose NCCL asynchronous error is set on some local rank
// (ncclCommGetAsyncError: a peer aborted or its process died, which also ends this rank's kernels early),
// each with the error described.
std::vector<std::pair<int64_t, std::string>> CommAsyncErrors();

// Forgets every recorded fault (their communicators were destroyed).
void ClearCommFaults();

// Notes that a handler captured an NCCL call on `comm_id` into a CUDA graph.
void MarkCommCaptured(int64_t comm_id);

// Records the fault and stops `comm_id`'s communicators so that their queued and running kernels return. Used
// by the watchdog on a call that does not finish, and by check_errors on a call another process found hung. A
// communicator without captured calls is aborted (ncclCommAbort, which frees it); one with captured calls is
// revoked (ncclCommRevoke) and kept until DestroyAllComms, because graphs that hold its kernels may still be
// replayed and must not find it freed. A rank whose handler holds a lease is stopped when the lease ends, by
// that handler's thread; the others at once. Never waits for a handler.
void AbortComm(int64_t comm_id, std::string message);

// Destroys every registered communicator and empties the registry. Programs still running with them must
// have finished. Keeps going past failures and returns the first one. Touches CUDA only when there are
// communicators, and then leaves the caller's current device current.
ffi::Error DestroyAllComms(std::string_view op);

// Success for ncclSuccess, else an error naming `call` with NCCL's description and last message.
ffi::Error CheckNccl(std::string_view op, std::string_view call, ncclResult_t result, ncclComm_t comm);

// Success for cudaSuccess, else an error naming `call` with CUDA's description.
ffi::Error CheckCuda(std::string_view op, std::string_view call, cudaError_t result);

// The NCCL type for reducing `dtype`; InvalidArgument naming the dtype if NCCL cannot reduce it.
ffi::ErrorOr<ncclDataType_t> NcclReductionType(std::string_view op, ffi::DataType dtype);

// NCCL's name for `reduce`.
ncclRedOp_t NcclReduceOp(ReduceOp reduce);

// Runs `body` (a callable returning ffi::Error), then makes the caller's CUDA device current again:
// creating and destroying communicators switches devices.
template <typename Body>
ffi::Error KeepingCurrentDevice(std::string_view op, Body body) {
  int device = 0;
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaGetDevice", cudaGetDevice(&device)));
  ffi::Error result = body();
  ffi::Error restored = CheckCuda(op, "cudaSetDevice", cudaSetDevice(device));
  return result.failure() ? result : restored;
}

// Issues the NCCL calls of `issue` (a callable returning ffi::Error) between ncclGroupStart and
// ncclGroupEnd. The group is closed even when issuing fails, so that this thread's NCCL state stays sane.
template <typename Issue>
ffi::Error InNcclGroup(std::string_view op, ncclComm_t comm, Issue issue) {
  NCCLX_RETURN_IF_ERROR(CheckNccl(op, "ncclGroupStart", ncclGroupStart(), comm));
  ffi::Error issued = issue();
  ffi::Error ended = CheckNccl(op, "ncclGroupEnd", ncclGroupEnd(), comm);
  return issued.failure() ? issued : ended;
}

}  // namespace jax_ncclx
