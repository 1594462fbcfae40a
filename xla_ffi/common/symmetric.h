// The process-wide registry of symmetric device memory (see symmetric_layout.h): per communicator and
// local device, the control block, the growable data region, and the peer table the NVLink kernels read.
//
// Setting it up is collective and host-synchronous, so it runs while a program is being lowered (from the
// Python thread, like communicator creation), never inside a handler. Handlers only look it up.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/checks.h"
#include "common/symmetric_layout.h"

namespace jax_ncclx {

// One local rank's symmetric memory, as a handler needs it.
struct SymmetricRank {
  int rank = -1;
  int size = 0;
  const PeerTable* table = nullptr;   // device pointer; stable for the communicator's lifetime
  SymmetricControl* control = nullptr;  // this rank's own control block (device pointer)
  uint8_t* data = nullptr;            // this rank's own data region (device pointer)
  int64_t parity_half_bytes = 0;      // the low-latency slots: two halves of this size at the start
  int64_t staging_bytes = 0;          // the all_to_allv_dynamic staging area after them
  const NvlinkFault* fault = nullptr;  // this rank's fault record (host pointer; the kernels write it)
  bool same_process = false;  // every rank lives in this process, so peers can use each other's pointers
};

// What one op needs of the data region (symmetric_layout.h): low-latency slots of `parity_half_bytes` per
// call parity, and an all_to_allv_dynamic staging area of `staging_bytes`.
struct SymmetricNeed {
  int64_t parity_half_bytes = 0;
  int64_t staging_bytes = 0;
};

// One local rank's part of a host exchange: its device, its rank, and the bytes it publishes.
struct ExchangeEntry {
  int32_t device = 0;
  int rank = 0;
  std::string blob;
};

// Exchanges small blobs among the ranks of a communicator on the host (jax_ncclx passes one that goes
// through JAX's key-value store, or stays in memory when every rank is local): given every local rank's entry,
// returns for each of them, in the same order, the blobs of all ranks of its group in rank order. Collective.
using HostExchange =
    std::function<ffi::ErrorOr<std::vector<std::vector<std::string>>>(const std::vector<ExchangeEntry>&)>;

// A communicator's symmetric memory is set up in two explicit steps, both collective: every process holding
// ranks of the communicator calls them in the same order as its other collective set-up. Addresses and IPC
// handles travel through `exchange`, not through NCCL (a NCCL collective would make NCCL connect its rings
// and allocate their buffers, hundreds of MiB, for a few hundred bytes).
//
// ConnectSymmetric, once per communicator: allocates every rank's control block, peer table and fault record,
// agrees on whether every rank reaches every peer through NVLink peer access, and maps the peers. Returns ""
// when the NVLink kernels can run, otherwise why not (a rank cannot reach a peer, too many ranks, ...). That
// answer is the same on every rank, and is remembered: later calls return it without communicating.
ffi::ErrorOr<std::string> ConnectSymmetric(std::string_view op, int64_t comm_id, const HostExchange& exchange);

// GrowSymmetric, whenever a program needs more: makes every rank's data region meet `need` (grown, never
// shrunk) and maps it into all peers. An error if ConnectSymmetric did not find the communicator usable.
// While the memory grows (a device sync and the exchange, which may wait for other processes) only this
// communicator's handlers wait; other communicators' handlers and the watchdog's fault scan
// (NvlinkFaultReports) go on.
ffi::Error GrowSymmetric(std::string_view op, int64_t comm_id, const SymmetricNeed& need, const HostExchange& exchange);

// The symmetric memory of `comm_id` on `device_ordinal`; an error if it was never connected or cannot use NVLink.
ffi::ErrorOr<SymmetricRank> LookupSymmetric(std::string_view op, int64_t comm_id, int32_t device_ordinal);

// An error naming `op` where a call's `need` bytes exceed what the low-latency slots hold per call parity.
inline ffi::Error CheckSlots(std::string_view op, int64_t need, const SymmetricRank& symmetric) {
  if (need <= symmetric.parity_half_bytes) return ffi::Error::Success();
  return Internal(op, "the symmetric low-latency slots hold " + std::to_string(symmetric.parity_half_bytes) +
                          " bytes per call parity but this call needs " + std::to_string(need) +
                          "; they are sized when the program is lowered by jax_ncclx");
}

// The fault records of every local rank whose NVLink kernels gave up waiting (state != kNvlinkHealthy).
struct NvlinkFaultReport {
  int64_t comm_id = 0;
  int32_t device = 0;
  int rank = -1;
  int size = 0;
  NvlinkFault fault;
};
std::vector<NvlinkFaultReport> NvlinkFaultReports();

// Device bytes held per (communicator, local device).
struct SymmetricUsage {
  int64_t comm_id = 0;
  int32_t device = 0;
  int64_t data_bytes = 0;         // the data region (grows to the largest need so far)
  int64_t low_latency_bytes = 0;  // of which the low-latency slots (both parities)
  int64_t control_bytes = 0;      // control block and peer table (fixed)
  int64_t pinned_host_bytes = 0;  // the fault record, in pinned host memory mapped for the device
};
std::vector<SymmetricUsage> SymmetricMemoryUsage();

// The complete device timeline records (DeviceTraceRecord) of every local rank of `comm_id`, oldest first.
// Host-synchronous: waits for the local devices to go idle, so call it between steps, not during one.
struct RankTrace {
  int32_t device = 0;
  int rank = -1;
  std::vector<DeviceTraceRecord> records;
};
ffi::ErrorOr<std::vector<RankTrace>> ReadDeviceTrace(std::string_view op, int64_t comm_id);

// Frees every rank's symmetric memory (after waiting for the local devices to go idle) and forgets every
// answer of ConnectSymmetric. Call before destroying the communicators.
ffi::Error FreeAllSymmetric(std::string_view op);

// Counts a host launch of an NVLink kernel on `stream`, noting whether the stream was being recorded into a
// CUDA graph (a replayed graph launches the kernel without calling the handler). Called by every NVLink
// handler.
ffi::Error CountNvlinkLaunch(std::string_view op, cudaStream_t stream);

struct NvlinkLaunchCounts {
  int64_t launches = 0;
  int64_t captured = 0;
};
NvlinkLaunchCounts GetNvlinkLaunchCounts();

// SMs of `device_ordinal`, asked of CUDA once per device (handlers run on every call).
ffi::ErrorOr<int> SmCount(std::string_view op, int32_t device_ordinal);

}  // namespace jax_ncclx
