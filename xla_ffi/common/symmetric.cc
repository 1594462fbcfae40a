// Symmetric memory set-up: allocate, exchange addresses on the host (HostExchange), check that every
// pair of ranks can reach each other over NVLink peer access, map, and publish the peer tables.
#include "common/symmetric.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <type_traits>
#include <utility>

#include "common/nccl_comms.h"

namespace jax_ncclx {
namespace {

// What each rank tells the others about itself and its symmetric memory.
struct RankInfo {
  uint64_t host = 0;  // hash of the host name: ranks on other hosts are not reachable
  int32_t pid = 0;    // same process: plain peer pointers; other process: CUDA IPC
  int32_t device = 0;
  char pci_bus_id[32] = {};
  uint64_t control_ptr = 0;
  uint64_t data_ptr = 0;
  cudaIpcMemHandle_t control_handle = {};
  cudaIpcMemHandle_t data_handle = {};
};

struct LocalRank {
  int32_t device = 0;
  int rank = -1;
  int size = 0;
  SymmetricControl* control = nullptr;
  NvlinkFault* fault = nullptr;  // pinned host memory, mapped (the same address on the device)
  PeerTable* table = nullptr;  // device copy of `peers`
  uint8_t* data = nullptr;
  SymmetricNeed layout;  // how data is divided (symmetric_layout.h)
  PeerTable peers = {};                     // host copy
  std::vector<bool> imported;               // per rank: mapped through CUDA IPC (close, don't free)
};

struct CommMemory {
  // Exclusive while the memory grows (a device sync and a host exchange that may wait for other processes);
  // this communicator's handlers read under it shared. No other communicator waits for it.
  std::shared_mutex mu;
  std::string unavailable;  // non-empty: the NVLink path cannot run on this communicator, and why
  std::vector<LocalRank> ranks;
};

// A local rank's fault record, listed apart so that the watchdog's scan never waits for a growth.
struct FaultRecord {
  int64_t comm_id = 0;
  int32_t device = 0;
  int rank = -1;
  int size = 0;
  const NvlinkFault* fault = nullptr;  // pinned host memory, freed only by FreeAllSymmetric
};

struct Registry {
  std::mutex setup_mu;   // one Connect/GrowSymmetric or FreeAllSymmetric at a time
  std::shared_mutex mu;  // the two below; held only to read or change them, never across CUDA or the exchange
  std::map<int64_t, std::shared_ptr<CommMemory>> comms;
  std::vector<FaultRecord> fault_records;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed, like the communicator registry
  return *registry;
}

// The memory of `comm_id` (null when it has none); the caller takes its lock.
std::shared_ptr<CommMemory> FindCommMemory(int64_t comm_id) {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  const auto found = registry.comms.find(comm_id);
  return found == registry.comms.end() ? nullptr : found->second;
}

// Every registered communicator's memory; the caller takes each one's lock.
std::vector<std::pair<int64_t, std::shared_ptr<CommMemory>>> AllCommMemory() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  return {registry.comms.begin(), registry.comms.end()};
}

// Which machine a rank runs on, as NCCL tells them apart: NCCL_HOSTID where set, else the host name and the
// kernel's boot id, so that containers of one host name on different machines are not taken for one host.
uint64_t HostHash() {
  if (const char* id = std::getenv("NCCL_HOSTID"); id != nullptr && *id != '\0') {
    return std::hash<std::string>()(id);
  }
  char name[HOST_NAME_MAX + 1] = {};
  gethostname(name, sizeof(name) - 1);
  std::string key(name);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (std::getline(boot, boot_id)) key += "/" + boot_id;
  return std::hash<std::string>()(key);
}

int64_t RoundUp(int64_t bytes, int64_t multiple) { return (bytes + multiple - 1) / multiple * multiple; }

// All-gathers `mine` (one value per local rank) through `exchange`: result[i][r] is rank r's value as seen by
// local rank i.
template <typename T>
ffi::ErrorOr<std::vector<std::vector<T>>> AllGather(std::string_view op, const std::vector<LocalRank>& ranks,
                                                    const std::vector<T>& mine, const HostExchange& exchange) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<ExchangeEntry> entries(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    entries[i] = {ranks[i].device, ranks[i].rank, std::string(reinterpret_cast<const char*>(&mine[i]), sizeof(T))};
  }
  ffi::ErrorOr<std::vector<std::vector<std::string>>> blobs = exchange(entries);
  if (blobs.has_error()) return blobs.error();
  if (blobs->size() != ranks.size()) {
    return Internal(op, "the host exchange returned " + std::to_string(blobs->size()) + " lists for " +
                            std::to_string(ranks.size()) + " local ranks");
  }
  std::vector<std::vector<T>> gathered(ranks.size(), std::vector<T>(ranks.front().size));
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::vector<std::string>& got = (*blobs)[i];
    if (static_cast<int>(got.size()) != ranks[i].size) {
      return Internal(op, "the host exchange returned " + std::to_string(got.size()) + " blobs for a group of " +
                              std::to_string(ranks[i].size) + " ranks");
    }
    for (int r = 0; r < ranks[i].size; ++r) {
      if (got[r].size() != sizeof(T)) {
        return Internal(op, "the host exchange returned " + std::to_string(got[r].size()) + " bytes from rank " +
                                std::to_string(r) + ", expected " + std::to_string(sizeof(T)) +
                                " (a process running another jax_ncclx build?)");
      }
      std::memcpy(&gathered[i][r], got[r].data(), sizeof(T));
    }
  }
  return gathered;
}

// Why local rank `self` cannot write into and signal every peer described in `infos`; "" when it can.
std::string Unreachable(const LocalRank& self, const std::vector<RankInfo>& infos) {
  const RankInfo& mine = infos[self.rank];
  for (int peer = 0; peer < self.size; ++peer) {
    if (peer == self.rank) continue;
    const RankInfo& other = infos[peer];
    const std::string who = "rank " + std::to_string(self.rank) + " cannot reach rank " + std::to_string(peer);
    if (other.host != mine.host) return who + ": it is on another host";
    int peer_device = other.device;
    if (other.pid != mine.pid && cudaDeviceGetByPCIBusId(&peer_device, other.pci_bus_id) != cudaSuccess) {
      cudaGetLastError();
      return who + ": its GPU (" + other.pci_bus_id + ") is not visible to this process (CUDA_VISIBLE_DEVICES)";
    }
    int access = 0;
    int atomics = 0;
    cudaDeviceCanAccessPeer(&access, self.device, peer_device);
    cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, self.device, peer_device);
    cudaGetLastError();
    // NVLink gives both; PCIe peer access has no native atomics, and the kernels' flags need them.
    if (!access || !atomics) return who + ": no NVLink peer access with native atomics between the GPUs";
  }
  return "";
}

// Maps `info`'s region (or returns its pointer when it lives in this process).
ffi::ErrorOr<void*> MapPeer(std::string_view op, const LocalRank& self, const RankInfo& mine, const RankInfo& info,
                            uint64_t ptr, const cudaIpcMemHandle_t& handle, bool* imported) {
  *imported = info.pid != mine.pid;
  if (!*imported) {
    if (info.device != self.device) {
      const cudaError_t enabled = cudaDeviceEnablePeerAccess(info.device, 0);
      if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else {
        NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaDeviceEnablePeerAccess", enabled));
      }
    }
    return reinterpret_cast<void*>(ptr);
  }
  void* mapped = nullptr;
  NCCLX_RETURN_IF_ERROR(
      CheckCuda(op, "cudaIpcOpenMemHandle", cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess)));
  return mapped;
}

// Releases local rank memory: closes IPC mappings of the peers' data (and control, if `everything`), then
// frees this rank's own data (and control and table, if `everything`). The device must be idle.
void Release(LocalRank& rank, bool everything) {
  cudaSetDevice(rank.device);
  for (int peer = 0; peer < rank.size && peer < static_cast<int>(rank.imported.size()); ++peer) {
    if (!rank.imported[peer]) continue;
    if (rank.peers.data[peer] != nullptr) cudaIpcCloseMemHandle(rank.peers.data[peer]);
    if (everything && rank.peers.control[peer] != nullptr) cudaIpcCloseMemHandle(rank.peers.control[peer]);
  }
  std::fill(std::begin(rank.peers.data), std::end(rank.peers.data), nullptr);
  if (rank.data != nullptr) cudaFree(rank.data);
  rank.data = nullptr;
  rank.layout = {};
  if (everything) {
    if (rank.control != nullptr) cudaFree(rank.control);
    if (rank.table != nullptr) cudaFree(rank.table);
    if (rank.fault != nullptr) cudaFreeHost(rank.fault);
    rank.fault = nullptr;
    rank.control = nullptr;
    rank.table = nullptr;
    rank.peers = {};
    rank.imported.clear();
  }
  cudaGetLastError();
}

ffi::Error SynchronizeDevices(std::string_view op, const std::vector<LocalRank>& ranks) {
  for (const LocalRank& rank : ranks) {
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaSetDevice", cudaSetDevice(rank.device)));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaDeviceSynchronize", cudaDeviceSynchronize()));
  }
  return ffi::Error::Success();
}

int64_t DataBytes(const SymmetricNeed& layout) { return 2 * layout.parity_half_bytes + layout.staging_bytes; }

// (Re)allocates every local rank's data region to `layout` (and, the first time, its control block and
// table), exchanges addresses, agrees on reachability, and maps the peers. Returns the unavailability
// reason ("" on success). On a reachability failure everything is released again.
ffi::ErrorOr<std::string> Grow(std::string_view op, CommMemory& memory, const SymmetricNeed& layout, bool first,
                               const HostExchange& exchange) {
  const int64_t data_bytes = std::max<int64_t>(DataBytes(layout), 1);
  std::vector<LocalRank>& ranks = memory.ranks;
  // Kernels still queued may use the old regions: finish them before freeing. A peer's writes into this
  // rank's region belong to calls this rank takes part in, so they are done once this rank's calls are.
  NCCLX_RETURN_IF_ERROR(SynchronizeDevices(op, ranks));
  std::vector<RankInfo> mine(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    LocalRank& rank = ranks[i];
    Release(rank, /*everything=*/false);
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaSetDevice", cudaSetDevice(rank.device)));
    if (first) {
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMalloc (control)",
                                      cudaMalloc(reinterpret_cast<void**>(&rank.control), sizeof(SymmetricControl))));
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMemset", cudaMemset(rank.control, 0, sizeof(SymmetricControl))));
      NCCLX_RETURN_IF_ERROR(
          CheckCuda(op, "cudaMalloc (table)", cudaMalloc(reinterpret_cast<void**>(&rank.table), sizeof(PeerTable))));
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaHostAlloc (fault record)",
                                      cudaHostAlloc(reinterpret_cast<void**>(&rank.fault), sizeof(NvlinkFault),
                                                    cudaHostAllocMapped | cudaHostAllocPortable)));
      std::memset(rank.fault, 0, sizeof(NvlinkFault));
      void* fault_on_device = nullptr;
      NCCLX_RETURN_IF_ERROR(
          CheckCuda(op, "cudaHostGetDevicePointer", cudaHostGetDevicePointer(&fault_on_device, rank.fault, 0)));
      rank.peers.fault = static_cast<NvlinkFault*>(fault_on_device);
      rank.imported.assign(rank.size, false);
    }
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMalloc (data region of " + std::to_string(data_bytes) + " bytes)",
                                    cudaMalloc(reinterpret_cast<void**>(&rank.data), data_bytes)));
    // Low-latency words carry a nonzero tag: zeroed memory never passes for a word that arrived.
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMemset (data region)", cudaMemset(rank.data, 0, data_bytes)));
    rank.layout = layout;

    RankInfo& info = mine[i];
    info.host = HostHash();
    info.pid = static_cast<int32_t>(getpid());
    info.device = rank.device;
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaDeviceGetPCIBusId",
                                    cudaDeviceGetPCIBusId(info.pci_bus_id, sizeof(info.pci_bus_id), rank.device)));
    info.control_ptr = reinterpret_cast<uint64_t>(rank.control);
    info.data_ptr = reinterpret_cast<uint64_t>(rank.data);
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(op, "cudaIpcGetMemHandle", cudaIpcGetMemHandle(&info.control_handle, rank.control)));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaIpcGetMemHandle", cudaIpcGetMemHandle(&info.data_handle, rank.data)));
  }
  ffi::ErrorOr<std::vector<std::vector<RankInfo>>> infos = AllGather(op, ranks, mine, exchange);
  if (infos.has_error()) return infos.error();

  if (first) {
    // Every rank must take the same path: agree on the first reason any rank found (by rank order).
    struct Verdict {
      char reason[240];
    };
    std::vector<Verdict> verdicts(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      const std::string reason = Unreachable(ranks[i], (*infos)[i]);
      std::snprintf(verdicts[i].reason, sizeof(verdicts[i].reason), "%s", reason.c_str());
    }
    ffi::ErrorOr<std::vector<std::vector<Verdict>>> all = AllGather(op, ranks, verdicts, exchange);
    if (all.has_error()) return all.error();
    for (const Verdict& verdict : all->front()) {
      if (verdict.reason[0] == '\0') continue;
      for (LocalRank& rank : ranks) Release(rank, /*everything=*/true);
      return std::string(verdict.reason);
    }
  }

  for (size_t i = 0; i < ranks.size(); ++i) {
    LocalRank& rank = ranks[i];
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaSetDevice", cudaSetDevice(rank.device)));
    const std::vector<RankInfo>& all = (*infos)[i];
    for (int peer = 0; peer < rank.size; ++peer) {
      const RankInfo& info = all[peer];
      bool imported = false;
      if (first) {
        ffi::ErrorOr<void*> control = MapPeer(op, rank, all[rank.rank], info, info.control_ptr, info.control_handle,
                                              &imported);
        if (control.has_error()) return control.error();
        rank.peers.control[peer] = static_cast<SymmetricControl*>(*control);
      }
      ffi::ErrorOr<void*> data = MapPeer(op, rank, all[rank.rank], info, info.data_ptr, info.data_handle, &imported);
      if (data.has_error()) return data.error();
      rank.peers.data[peer] = static_cast<uint8_t*>(*data);
      rank.imported[peer] = imported;
    }
    rank.peers.parity_half_bytes = layout.parity_half_bytes;
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMemcpy (peer table)",
                                    cudaMemcpy(rank.table, &rank.peers, sizeof(PeerTable), cudaMemcpyHostToDevice)));
  }
  return std::string();
}

// A state error (RuntimeError in Python), not a bad argument: growing before connecting, or where NVLink failed.
ffi::Error NotConnected(std::string_view op, int64_t comm_id, std::string_view what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jax_ncclx " + std::string(op) + ": communicator " +
                                                             std::to_string(comm_id) + " " + std::string(what));
}

// Both steps: `connect` makes a new communicator's memory (with an empty data region) and returns its verdict;
// otherwise the communicator must be connected and usable, and its data region grows to `need`.
ffi::ErrorOr<std::string> SetUpSymmetric(std::string_view op, int64_t comm_id, const SymmetricNeed& need, bool connect,
                                         const HostExchange& exchange) {
  if (need.parity_half_bytes < 0 || need.staging_bytes < 0) {
    return InvalidArgument(op, "negative symmetric memory need: " + std::to_string(need.parity_half_bytes) +
                                   " low-latency bytes per parity, " + std::to_string(need.staging_bytes) +
                                   " staging bytes");
  }
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> setup(registry.setup_mu);
  std::shared_ptr<CommMemory> memory = FindCommMemory(comm_id);
  const bool first = memory == nullptr;
  if (!connect && first) {
    return NotConnected(op, comm_id, "has no symmetric memory to grow: connect it first (connect_symmetric)");
  }
  // A new communicator's memory is set up before the registry lists it, so nothing can look it up half made.
  if (first) memory = std::make_shared<CommMemory>();
  std::unique_lock<std::shared_mutex> growing(memory->mu);
  auto publish = [&] {
    std::unique_lock<std::shared_mutex> lock(registry.mu);
    registry.comms.emplace(comm_id, memory);
    for (const LocalRank& rank : memory->ranks) {
      if (rank.fault != nullptr) {
        registry.fault_records.push_back({comm_id, rank.device, rank.rank, rank.size, rank.fault});
      }
    }
  };
  if (!first) {
    if (connect || !memory->unavailable.empty()) return memory->unavailable;
    const bool big_enough = std::all_of(memory->ranks.begin(), memory->ranks.end(), [&](const LocalRank& rank) {
      return rank.layout.parity_half_bytes >= need.parity_half_bytes && rank.layout.staging_bytes >= need.staging_bytes;
    });
    if (big_enough) return std::string();
  } else {
    ffi::ErrorOr<std::map<int32_t, CommMember>> members = CommMembers(op, comm_id);
    if (members.has_error()) return members.error();
    for (const auto& [device, member] : *members) {
      LocalRank rank;
      rank.device = device;
      rank.rank = member.rank;
      rank.size = member.size;
      memory->ranks.push_back(rank);
    }
    if (memory->ranks.empty()) return InvalidArgument(op, "communicator has no rank in this process");
    if (memory->ranks.front().size > kMaxNvlinkRanks) {
      memory->unavailable = "the communicator has " + std::to_string(memory->ranks.front().size) +
                            " ranks; the NVLink kernels handle at most " + std::to_string(kMaxNvlinkRanks);
      publish();
      return memory->unavailable;
    }
  }
  // A part that grows takes at least half again, so a run of slightly larger programs does not reallocate
  // each time; the other part keeps its size.
  const SymmetricNeed current = first ? SymmetricNeed{} : memory->ranks.front().layout;
  auto grow = [](int64_t have, int64_t want, int64_t multiple) {
    return want <= have ? have : RoundUp(std::max(want, have * 3 / 2), multiple);
  };
  SymmetricNeed grown;
  grown.parity_half_bytes = grow(current.parity_half_bytes, need.parity_half_bytes, 1 << 16);
  grown.staging_bytes = grow(current.staging_bytes, need.staging_bytes, 1 << 21);

  std::string reason;
  NCCLX_RETURN_IF_ERROR(KeepingCurrentDevice(op, [&]() -> ffi::Error {
    ffi::ErrorOr<std::string> grew = Grow(op, *memory, grown, first, exchange);
    if (grew.has_error()) {
      if (first) {
        for (LocalRank& rank : memory->ranks) Release(rank, /*everything=*/true);
      } else {
        // The old regions are gone and the peer tables may still point at them (programs captured into
        // CUDA graphs hold those tables): nothing may run on this communicator any more, replays included.
        memory->unavailable = "growing its symmetric memory failed: " + std::string(grew.error().message());
        RecordCommFault(comm_id, "jax_ncclx " + std::string(op) + ": " + memory->unavailable);
      }
      return grew.error();
    }
    reason = *grew;
    return ffi::Error::Success();
  }));
  if (first) {
    memory->unavailable = reason;
    publish();
  }
  return reason;
}

}  // namespace

ffi::ErrorOr<std::string> ConnectSymmetric(std::string_view op, int64_t comm_id, const HostExchange& exchange) {
  return SetUpSymmetric(op, comm_id, SymmetricNeed{}, /*connect=*/true, exchange);
}

ffi::Error GrowSymmetric(std::string_view op, int64_t comm_id, const SymmetricNeed& need,
                         const HostExchange& exchange) {
  ffi::ErrorOr<std::string> reason = SetUpSymmetric(op, comm_id, need, /*connect=*/false, exchange);
  if (reason.has_error()) return reason.error();
  if (!reason->empty()) return NotConnected(op, comm_id, "cannot use the NVLink kernels: " + *reason);
  return ffi::Error::Success();
}

ffi::ErrorOr<SymmetricRank> LookupSymmetric(std::string_view op, int64_t comm_id, int32_t device_ordinal) {
  const std::shared_ptr<CommMemory> memory = FindCommMemory(comm_id);
  std::shared_lock<std::shared_mutex> lock;
  if (memory != nullptr) lock = std::shared_lock<std::shared_mutex>(memory->mu);  // only its own growth waits
  if (memory != nullptr && memory->unavailable.empty()) {
    for (const LocalRank& rank : memory->ranks) {
      if (rank.device != device_ordinal) continue;
      SymmetricRank view;
      view.rank = rank.rank;
      view.size = rank.size;
      view.table = rank.table;
      view.control = rank.control;
      view.data = rank.data;
      view.parity_half_bytes = rank.layout.parity_half_bytes;
      view.staging_bytes = rank.layout.staging_bytes;
      view.fault = rank.fault;
      view.same_process = std::none_of(rank.imported.begin(), rank.imported.end(), [](bool i) { return i; });
      return view;
    }
  }
  return InvalidArgument(op, "no symmetric memory for communicator " + std::to_string(comm_id) + " on device " +
                                 std::to_string(device_ordinal) +
                                 "; was jax_ncclx shut down after this program was compiled?");
}

std::vector<NvlinkFaultReport> NvlinkFaultReports() {
  Registry& registry = GetRegistry();
  std::shared_lock<std::shared_mutex> lock(registry.mu);
  std::vector<NvlinkFaultReport> reports;
  for (const FaultRecord& record : registry.fault_records) {
    const volatile NvlinkFault* fault = record.fault;
    if (fault->state == kNvlinkHealthy) continue;
    NvlinkFaultReport report{record.comm_id, record.device, record.rank, record.size, {}};
    std::memcpy(&report.fault, record.fault, sizeof(NvlinkFault));
    reports.push_back(report);
  }
  return reports;
}

std::vector<SymmetricUsage> SymmetricMemoryUsage() {
  std::vector<SymmetricUsage> usage;
  for (const auto& [comm_id, memory] : AllCommMemory()) {
    std::shared_lock<std::shared_mutex> lock(memory->mu);
    for (const LocalRank& rank : memory->ranks) {
      if (rank.control == nullptr) continue;
      usage.push_back({comm_id, rank.device, DataBytes(rank.layout), 2 * rank.layout.parity_half_bytes,
                       static_cast<int64_t>(sizeof(SymmetricControl) + sizeof(PeerTable)),
                       static_cast<int64_t>(sizeof(NvlinkFault))});
    }
  }
  return usage;
}

ffi::ErrorOr<std::vector<RankTrace>> ReadDeviceTrace(std::string_view op, int64_t comm_id) {
  std::vector<RankTrace> traces;
  const std::shared_ptr<CommMemory> memory = FindCommMemory(comm_id);
  if (memory == nullptr) return traces;
  std::shared_lock<std::shared_mutex> lock(memory->mu);
  if (!memory->unavailable.empty()) return traces;
  NCCLX_RETURN_IF_ERROR(KeepingCurrentDevice(op, [&]() -> ffi::Error {
    std::vector<DeviceTraceRecord> ring(kTraceSlots);
    for (const LocalRank& rank : memory->ranks) {
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaSetDevice", cudaSetDevice(rank.device)));
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaDeviceSynchronize", cudaDeviceSynchronize()));
      NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMemcpy (trace)",
                                      cudaMemcpy(ring.data(), rank.control->trace,
                                                 sizeof(DeviceTraceRecord) * kTraceSlots, cudaMemcpyDeviceToHost)));
      RankTrace trace{rank.device, rank.rank, {}};
      for (int slot = 0; slot < kTraceSlots; ++slot) {
        if (IsCompleteTraceRecord(ring[slot], slot)) trace.records.push_back(ring[slot]);
      }
      std::sort(trace.records.begin(), trace.records.end(),
                [](const DeviceTraceRecord& a, const DeviceTraceRecord& b) { return a.epoch < b.epoch; });
      traces.push_back(std::move(trace));
    }
    return ffi::Error::Success();
  }));
  return traces;
}

ffi::Error FreeAllSymmetric(std::string_view op) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> setup(registry.setup_mu);
  std::map<int64_t, std::shared_ptr<CommMemory>> doomed;
  {
    std::unique_lock<std::shared_mutex> lock(registry.mu);
    doomed.swap(registry.comms);
    registry.fault_records.clear();
  }
  if (doomed.empty()) return ffi::Error::Success();  // nothing to free: leave CUDA alone
  return KeepingCurrentDevice(op, [&]() -> ffi::Error {
    ffi::Error first_failure;
    for (auto& [comm_id, memory] : doomed) {
      std::unique_lock<std::shared_mutex> lock(memory->mu);
      ffi::Error synced = SynchronizeDevices(op, memory->ranks);
      if (synced.failure() && first_failure.success()) first_failure = std::move(synced);
      for (LocalRank& rank : memory->ranks) Release(rank, /*everything=*/true);
    }
    return first_failure;
  });
}

namespace {
std::atomic<int64_t> nvlink_launches{0};
std::atomic<int64_t> nvlink_captured_launches{0};
}  // namespace

ffi::Error CountNvlinkLaunch(std::string_view op, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaStreamIsCapturing", cudaStreamIsCapturing(stream, &capture)));
  nvlink_launches.fetch_add(1, std::memory_order_relaxed);
  if (capture == cudaStreamCaptureStatusActive) nvlink_captured_launches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

NvlinkLaunchCounts GetNvlinkLaunchCounts() {
  return {nvlink_launches.load(std::memory_order_relaxed), nvlink_captured_launches.load(std::memory_order_relaxed)};
}

ffi::ErrorOr<int> SmCount(std::string_view op, int32_t device_ordinal) {
  auto query = [&]() -> ffi::ErrorOr<int> {
    int sm_count = 0;
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaDeviceGetAttribute",
                                    cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device_ordinal)));
    return sm_count;
  };
  static std::array<std::atomic<int>, 64> known{};  // by device ordinal
  if (device_ordinal < 0 || device_ordinal >= static_cast<int32_t>(known.size())) return query();
  return AskOnce(known[device_ordinal], query);
}

}  // namespace jax_ncclx
