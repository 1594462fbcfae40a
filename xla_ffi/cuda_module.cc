// The CUDA extension module _ncclx_cuda: FFI capsules of the NCCL handlers, version queries, and the
// functions through which the Python side creates, inspects and destroys the NCCL communicators that the
// handlers look up by comm_id.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/contract_attrs.h"
#include "common/checks.h"
#include "common/contract_bindings.h"
#include "common/monitor_bindings.h"
#include "common/nccl_comms.h"
#include "common/replay_watch.h"
#include "common/symmetric.h"
#include "common/trace_bindings.h"
#include "common/watchdog.h"
#include "ops/all_to_allv/all_to_allv_kernels.h"
#include "ops/moe/moe_routing_kernels.h"
#include "ops/moe/moe_combine.h"
#include "ops/moe/moe_dispatch.h"
#include "ops/moe/moe_masked.h"
#include "ops/collectives/nvlink_collectives_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_ncclx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllReduceCmdbuf);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllReduceCmdbufPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllGatherCmdbuf);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllGatherCmdbufPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclReduceScatterCmdbuf);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclReduceScatterCmdbufPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllToAllCmdbuf);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllToAllCmdbufPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclPpermute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclPpermuteCmdbuf);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclPpermuteCmdbufPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclAllToAllvDynamic);
#ifdef JAX_NCCLX_TESTING  // test-only (CMakeLists.txt, JAX_NCCLX_TESTING=ON)
XLA_FFI_DECLARE_HANDLER_SYMBOL(LaunchProbe);
#endif
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllToAllvDynamic);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllToAllvDynamicPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NcclRaggedAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkRaggedAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkRaggedAllToAllPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllReducePrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllGatherPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkAllToAllPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkReduceScatterPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeCombinePrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeDispatchPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeMaskedDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeMaskedDispatchPrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeMaskedCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvlinkMoeMaskedCombinePrepare);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaMoePlanSends);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaMoePlaceReceived);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaTakeRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaExpandRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaEncodeRows);

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// A target with a prepare stage besides execute (jax.ffi.register_ffi_target takes a dict of stages).
template <typename Prepare, typename Execute>
nb::dict Stages(Prepare* prepare, Execute* execute) {
  nb::dict stages;
  stages["prepare"] = Capsule(prepare);
  stages["execute"] = Capsule(execute);
  return stages;
}

// Bad arguments become ValueError, everything else (NCCL and CUDA failures) RuntimeError.
void ThrowIfFailed(const ffi::Error& error) {
  if (error.success()) return;
  if (error.errc() == ffi::ErrorCode::kInvalidArgument) throw nb::value_error(error.message().c_str());
  throw std::runtime_error(error.message());
}

template <typename T>
T ValueOrThrow(ffi::ErrorOr<T> value) {
  if (value.has_error()) ThrowIfFailed(value.error());
  return std::move(value).value();
}

void CheckDistinctDevices(std::string_view op, std::vector<int> devices) {
  std::sort(devices.begin(), devices.end());
  const auto twice = std::adjacent_find(devices.begin(), devices.end());
  if (twice != devices.end()) {
    ThrowIfFailed(InvalidArgument(op, "devices lists device " + std::to_string(*twice) + " twice"));
  }
}

// Creates one communicator per entry of `devices` inside one NCCL group (the ranks of one clique that live
// in this process must join together), calling create(i, &comm) with device i current. Entries that end
// up null (a split's NCCL_SPLIT_NOCOLOR) get no communicator. If anything fails, the communicators made so
// far are aborted. Called without the GIL.
template <typename Create>
ffi::ErrorOr<std::map<int32_t, ncclComm_t>> CreateInGroup(std::string_view op, const std::vector<int>& devices,
                                                          Create create) {
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ffi::Error created = KeepingCurrentDevice(op, [&] {
    return InNcclGroup(op, nullptr, [&]() -> ffi::Error {
      for (size_t i = 0; i < devices.size(); ++i) {
        NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaSetDevice", cudaSetDevice(devices[i])));
        NCCLX_RETURN_IF_ERROR(create(i, &comms[i]));
      }
      return ffi::Error::Success();
    });
  });
  if (created.failure()) {
    std::string message = created.message();
    for (ncclComm_t comm : comms) {
      if (comm == nullptr) continue;
      const ffi::Error aborted = CheckNccl(op, "ncclCommAbort", ncclCommAbort(comm), comm);
      if (aborted.failure()) message += "; cleaning up, " + aborted.message();
    }
    return ffi::Error(*created.errc(), message);
  }
  std::map<int32_t, ncclComm_t> by_device;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (comms[i] != nullptr) by_device.emplace(devices[i], comms[i]);
  }
  return by_device;
}

// Bytes of device `device` in use by anyone (total - free, cudaMemGetInfo): what NCCL and this module
// allocate outside XLA's allocator shows here.
int64_t DeviceMemoryUsed(int device) {
  constexpr std::string_view kOp = "device_memory_used";
  size_t free_bytes = 0, total_bytes = 0;
  ThrowIfFailed(KeepingCurrentDevice(kOp, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CheckCuda(kOp, "cudaSetDevice", cudaSetDevice(device)));
    return CheckCuda(kOp, "cudaMemGetInfo", cudaMemGetInfo(&free_bytes, &total_bytes));
  }));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

nb::bytes UniqueId() {
  ncclUniqueId id;
  ffi::Error error;
  {
    nb::gil_scoped_release release;
    error = CheckNccl("unique_id", "ncclGetUniqueId", ncclGetUniqueId(&id), nullptr);
  }
  ThrowIfFailed(error);
  return nb::bytes(id.internal, NCCL_UNIQUE_ID_BYTES);
}

int64_t RegisterCommMembers(int nranks, const std::vector<int>& ranks, const std::vector<int>& devices) {
  constexpr std::string_view kOp = "register_comm";
  if (ranks.empty() || ranks.size() != devices.size()) {
    ThrowIfFailed(InvalidArgument(kOp, "got " + std::to_string(ranks.size()) + " ranks and " +
                                           std::to_string(devices.size()) +
                                           " devices, expected one rank per device and at least one"));
  }
  CheckDistinctDevices(kOp, devices);
  std::map<int32_t, CommMember> members;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= nranks) {
      ThrowIfFailed(InvalidArgument(kOp, "rank " + std::to_string(ranks[i]) +
                                             " is outside [0, nranks=" + std::to_string(nranks) + ")"));
    }
    members[devices[i]] = CommMember{ranks[i], nranks};
  }
  return RegisterComm(std::move(members));
}

void InitComm(int64_t comm_id, const std::map<int, std::vector<nb::bytes>>& unique_ids, int max_ctas) {
  constexpr std::string_view kOp = "init_comm";
  if (max_ctas < 0) ThrowIfFailed(InvalidArgument(kOp, "max_ctas=" + std::to_string(max_ctas) + ", expected >= 0"));
  const std::map<int32_t, CommMember> members = ValueOrThrow(CommMembers(kOp, comm_id));
  std::vector<int> devices;
  std::vector<std::vector<ncclUniqueId>> ids;
  for (const auto& [device, member] : members) {
    const auto given = unique_ids.find(device);
    if (given == unique_ids.end() || given->second.empty() || static_cast<int>(given->second.size()) > member.size) {
      ThrowIfFailed(InvalidArgument(kOp, "device " + std::to_string(device) + " of communicator " +
                                             std::to_string(comm_id) +
                                             " needs 1 to nranks=" + std::to_string(member.size) + " unique ids, got " +
                                             std::to_string(given == unique_ids.end() ? 0 : given->second.size())));
    }
    std::vector<ncclUniqueId>& mine = ids.emplace_back();
    for (const nb::bytes& id : given->second) {
      if (id.size() != NCCL_UNIQUE_ID_BYTES) {
        ThrowIfFailed(InvalidArgument(kOp, "device " + std::to_string(device) + " got a unique id of " +
                                               std::to_string(id.size()) + " bytes, expected " +
                                               std::to_string(NCCL_UNIQUE_ID_BYTES)));
      }
      std::memcpy(mine.emplace_back().internal, id.data(), NCCL_UNIQUE_ID_BYTES);
    }
    devices.push_back(device);
  }
  if (unique_ids.size() != members.size()) {
    ThrowIfFailed(InvalidArgument(kOp, "got unique ids for " + std::to_string(unique_ids.size()) +
                                           " devices; communicator " + std::to_string(comm_id) + " has " +
                                           std::to_string(members.size()) + " here"));
  }

  // What creation takes on each device, seen through cudaMemGetInfo (device-wide, so exact only while
  // nothing else allocates on it; jax_ncclx creates communicators after the device's queued work is done).
  std::vector<int64_t> used_before(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) used_before[i] = DeviceMemoryUsed(devices[i]);
  ffi::ErrorOr<std::map<int32_t, ncclComm_t>> comms = [&] {
    nb::gil_scoped_release release;  // blocks until every rank of every clique has joined
    return CreateInGroup(kOp, devices, [&](size_t i, ncclComm_t* comm) {
      const CommMember& member = members.at(devices[i]);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;  // fields left undefined take NCCL's defaults
      if (max_ctas > 0) config.maxCTAs = max_ctas;
      if (ids[i].size() == 1) {
        return CheckNccl(kOp, "ncclCommInitRankConfig",
                         ncclCommInitRankConfig(comm, member.size, ids[i][0], member.rank, &config), *comm);
      }
      // Several roots share NCCL's bootstrap of a large communicator.
      const ncclResult_t result = ncclCommInitRankScalable(comm, member.size, member.rank,
                                                           static_cast<int>(ids[i].size()), ids[i].data(), &config);
      return CheckNccl(kOp, "ncclCommInitRankScalable", result, *comm);
    });
  }();
  std::map<int32_t, NcclRank> created;
  for (const auto& [device, comm] : ValueOrThrow(std::move(comms))) created[device].comm = comm;
  for (size_t i = 0; i < devices.size(); ++i) {
    created[devices[i]].init_bytes = std::max<int64_t>(0, DeviceMemoryUsed(devices[i]) - used_before[i]);
  }
  ThrowIfFailed(AttachNcclComms(kOp, comm_id, std::move(created)));
}

std::vector<std::tuple<int, int, int>> CommInfo(int64_t comm_id) {
  std::vector<std::tuple<int, int, int>> info;
  for (const auto& [device, member] : ValueOrThrow(CommMembers("comm_info", comm_id))) {
    info.emplace_back(device, member.rank, member.size);
  }
  return info;
}

void DestroyAll() {
  constexpr std::string_view kOp = "destroy_all";
  ffi::Error freed;
  ffi::Error destroyed;
  {
    nb::gil_scoped_release release;  // waits for the communicators' outstanding work
    StopWatchdog();
    freed = FreeAllSymmetric(kOp);   // before the communicators: their programs must be done with it
    destroyed = DestroyAllComms(kOp);
    ClearCommFaults();
    ForgetWatchedCalls();
  }
  ThrowIfFailed(freed);
  ThrowIfFailed(destroyed);
}

// The HostExchange of a Python callable: exchange([(device, rank, bytes), ...]) -> [[bytes per rank], ...].
// Called with the GIL released; takes it for the call.
HostExchange PythonExchange(std::string_view op, nb::callable exchange) {
  return [op, exchange = std::move(exchange)](
             const std::vector<ExchangeEntry>& entries) -> ffi::ErrorOr<std::vector<std::vector<std::string>>> {
    nb::gil_scoped_acquire acquire;
    try {
      nb::list mine;
      for (const ExchangeEntry& entry : entries) {
        mine.append(nb::make_tuple(entry.device, entry.rank, nb::bytes(entry.blob.data(), entry.blob.size())));
      }
      std::vector<std::vector<std::string>> gathered;
      for (nb::handle group : exchange(mine)) {
        std::vector<std::string>& blobs = gathered.emplace_back();
        for (nb::handle blob : group) {
          const nb::bytes bytes = nb::cast<nb::bytes>(blob);
          blobs.emplace_back(bytes.c_str(), bytes.size());
        }
      }
      return gathered;
    } catch (const std::exception& e) {  // nb::python_error, nb::cast_error
      return Internal(op, std::string("exchanging symmetric memory addresses failed: ") + e.what());
    }
  };
}

std::string ConnectSymmetricMemory(int64_t comm_id, nb::callable exchange) {
  constexpr std::string_view kOp = "connect_symmetric";
  const HostExchange host_exchange = PythonExchange(kOp, std::move(exchange));
  ffi::ErrorOr<std::string> reason = [&] {
    nb::gil_scoped_release release;  // collective: blocks until every rank has joined
    return ConnectSymmetric(kOp, comm_id, host_exchange);
  }();
  StartWatchdog();  // reports NVLink kernels that give up waiting as soon as they do
  return ValueOrThrow(std::move(reason));
}

void GrowSymmetricMemory(int64_t comm_id, int64_t staging_bytes, int64_t parity_half_bytes, nb::callable exchange) {
  constexpr std::string_view kOp = "grow_symmetric";
  const HostExchange host_exchange = PythonExchange(kOp, std::move(exchange));
  const ffi::Error grown = [&] {
    nb::gil_scoped_release release;  // collective: blocks until every rank has joined
    return GrowSymmetric(kOp, comm_id, SymmetricNeed{parity_half_bytes, staging_bytes}, host_exchange);
  }();
  ThrowIfFailed(grown);
}

using MemoryRow = std::tuple<int64_t, int, int64_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<MemoryRow> MemoryHeld() {
  // The registries' locks may be held by a symmetric memory exchange, which takes the GIL to call Python.
  nb::gil_scoped_release release;
  std::map<std::pair<int64_t, int>, MemoryRow> rows;
  auto row = [&](int64_t comm_id, int device) -> MemoryRow& {
    auto [it, added] = rows.try_emplace({comm_id, device}, MemoryRow{comm_id, device, 0, 0, 0, 0, 0});
    return it->second;
  };
  for (const auto& [comm_id, device] : RegisteredMembers()) row(comm_id, device);
  for (const auto& [comm_id, device, bytes] : CommInitBytes()) std::get<2>(row(comm_id, device)) = bytes;
  for (const SymmetricUsage& entry : SymmetricMemoryUsage()) {
    MemoryRow& r = row(entry.comm_id, entry.device);
    std::get<3>(r) = entry.data_bytes;
    std::get<4>(r) = entry.low_latency_bytes;
    std::get<5>(r) = entry.control_bytes;
    std::get<6>(r) = entry.pinned_host_bytes;
  }
  std::vector<MemoryRow> all;
  for (auto& [key, r] : rows) all.push_back(r);
  return all;
}

// (device, rank, records) per local rank; each record is a dict of DeviceTraceRecord's fields.
nb::list DeviceTrace(int64_t comm_id) {
  ffi::ErrorOr<std::vector<RankTrace>> traces = [&] {
    nb::gil_scoped_release release;  // waits for the devices
    return ReadDeviceTrace("device_trace", comm_id);
  }();
  nb::list result;
  for (const RankTrace& trace : ValueOrThrow(std::move(traces))) {
    nb::list records;
    for (const DeviceTraceRecord& r : trace.records) records.append(TraceRecordDict(r));
    result.append(nb::make_tuple(trace.device, trace.rank, records));
  }
  return result;
}

std::tuple<int64_t, int64_t> AllToAllvSymmetricBytes(int64_t batch, int64_t num_peers, int64_t num_chunks,
                                                     int64_t capacity, int64_t row_bytes, bool direct) {
  AllToAllvShape shape;
  shape.batch = batch;
  shape.num_peers = num_peers;
  shape.num_chunks = num_chunks;
  shape.capacity = capacity;
  shape.row_bytes = row_bytes;
  const NvlinkAllToAllvLayout layout = LayOutNvlinkAllToAllv(shape, direct);
  return {layout.staging_bytes, layout.counts_bytes};
}

int64_t AllToAllvWorkspaceBytes(int64_t batch, int64_t num_peers, int64_t num_chunks, int64_t capacity,
                                int64_t row_bytes, bool received_apart) {
  AllToAllvShape shape;
  shape.batch = batch;
  shape.num_peers = num_peers;
  shape.num_chunks = num_chunks;
  shape.capacity = capacity;
  shape.row_bytes = row_bytes;
  return NcclAllToAllvWorkspaceBytes(shape, received_apart);
}

int64_t PlanSendsScratch(int64_t batch, int64_t num_tokens, int64_t num_members) {
  PlanSendsShape shape;
  shape.batch = batch;
  shape.num_tokens = num_tokens;
  shape.num_members = num_members;
  return PlanSendsScratchBytes(shape);
}

int64_t NvlinkCollectiveBytes(const std::string& op, int algorithm, int protocol, int64_t bytes, int size,
                              int element_bytes, bool direct) {
  const std::optional<NvlinkCollective> named = NvlinkCollectiveNamed(op);
  if (!named) throw std::invalid_argument("nvlink_collective_bytes: no NVLink kernel for op '" + op + "'");
  const NvlinkCollective collective = *named;
  if (algorithm != 1 && !(algorithm == 2 && collective == NvlinkCollective::kAllReduce)) {
    throw std::invalid_argument("nvlink_collective_bytes: algorithm " + std::to_string(algorithm) +
                                " is not one of the op's (1 one-shot; 2 two-shot, all_reduce only)");
  }
  if (protocol < 0 || protocol > 2) {
    throw std::invalid_argument("nvlink_collective_bytes: protocol " + std::to_string(protocol) +
                                " is not 0 (LL128), 1 (LL) or 2 (simple)");
  }
  if (size < 1 || size > kMaxNvlinkRanks || element_bytes < 1 || bytes < 0) {
    throw std::invalid_argument("nvlink_collective_bytes: bad sizes");
  }
  return NvlinkCollectiveSlotBytes(collective, static_cast<NvlinkAlgorithm>(algorithm),
                                   static_cast<NvlinkProtocol>(protocol), bytes, size, element_bytes, direct);
}

int NcclVersion() {
  int version = 0;
  ThrowIfFailed(CheckNccl("nccl_version", "ncclGetVersion", ncclGetVersion(&version), nullptr));
  return version;
}

int CudaRuntimeVersion() {
  int version = 0;
  ThrowIfFailed(CheckCuda("cuda_runtime_version", "cudaRuntimeGetVersion", cudaRuntimeGetVersion(&version)));
  return version;
}

// Every CUDA handler, by what the lowering chooses it by: the op, its transport and its variants. A handler XLA
// may record into a command buffer (an NVLink kernel, an NCCL call marked compatible) comes twice: as is, and
// watched, with the prepare stage that refuses an execution on a failed communicator, since replays never call
// the handler (the lowering's choice under JAX_NCCLX_WATCH_REPLAYS=1: it costs host time in every execution).
struct Handler {
  const char* target;     // the FFI target name
  const char* op;         // the op whose lowering takes it (the primitive's name without "ncclx_")
  const char* transport;  // "nccl", "nvlink", or "local" (no communication)
  bool cmdbuf;            // an NCCL handler marked command-buffer compatible
  bool watched;           // with the prepare stage
  nb::object capsule;
};

std::vector<Handler> Handlers() {
  return {
      {"ncclx_all_reduce", "all_reduce", "nccl", false, false, Capsule(NcclAllReduce)},
      {"ncclx_all_reduce_cmdbuf", "all_reduce", "nccl", true, false, Capsule(NcclAllReduceCmdbuf)},
      {"ncclx_all_reduce_cmdbuf_watched", "all_reduce", "nccl", true, true,
       Stages(NcclAllReduceCmdbufPrepare, NcclAllReduceCmdbuf)},
      {"ncclx_all_gather", "all_gather", "nccl", false, false, Capsule(NcclAllGather)},
      {"ncclx_all_gather_cmdbuf", "all_gather", "nccl", true, false, Capsule(NcclAllGatherCmdbuf)},
      {"ncclx_all_gather_cmdbuf_watched", "all_gather", "nccl", true, true,
       Stages(NcclAllGatherCmdbufPrepare, NcclAllGatherCmdbuf)},
      {"ncclx_reduce_scatter", "reduce_scatter", "nccl", false, false, Capsule(NcclReduceScatter)},
      {"ncclx_reduce_scatter_cmdbuf", "reduce_scatter", "nccl", true, false, Capsule(NcclReduceScatterCmdbuf)},
      {"ncclx_reduce_scatter_cmdbuf_watched", "reduce_scatter", "nccl", true, true,
       Stages(NcclReduceScatterCmdbufPrepare, NcclReduceScatterCmdbuf)},
      {"ncclx_all_to_all", "all_to_all", "nccl", false, false, Capsule(NcclAllToAll)},
      {"ncclx_all_to_all_cmdbuf", "all_to_all", "nccl", true, false, Capsule(NcclAllToAllCmdbuf)},
      {"ncclx_all_to_all_cmdbuf_watched", "all_to_all", "nccl", true, true,
       Stages(NcclAllToAllCmdbufPrepare, NcclAllToAllCmdbuf)},
      {"ncclx_ppermute", "ppermute", "nccl", false, false, Capsule(NcclPpermute)},
      {"ncclx_ppermute_cmdbuf", "ppermute", "nccl", true, false, Capsule(NcclPpermuteCmdbuf)},
      {"ncclx_ppermute_cmdbuf_watched", "ppermute", "nccl", true, true,
       Stages(NcclPpermuteCmdbufPrepare, NcclPpermuteCmdbuf)},
      {"ncclx_all_to_allv_dynamic", "all_to_allv_dynamic", "nccl", false, false, Capsule(NcclAllToAllvDynamic)},
      {"ncclx_all_to_allv_dynamic_nvlink", "all_to_allv_dynamic", "nvlink", false, false,
       Capsule(NvlinkAllToAllvDynamic)},
      {"ncclx_all_to_allv_dynamic_nvlink_watched", "all_to_allv_dynamic", "nvlink", false, true,
       Stages(NvlinkAllToAllvDynamicPrepare, NvlinkAllToAllvDynamic)},
      {"ncclx_ragged_all_to_all", "ragged_all_to_all", "nccl", false, false, Capsule(NcclRaggedAllToAll)},
      {"ncclx_ragged_all_to_all_nvlink", "ragged_all_to_all", "nvlink", false, false, Capsule(NvlinkRaggedAllToAll)},
      {"ncclx_ragged_all_to_all_nvlink_watched", "ragged_all_to_all", "nvlink", false, true,
       Stages(NvlinkRaggedAllToAllPrepare, NvlinkRaggedAllToAll)},
      {"ncclx_all_reduce_nvlink", "all_reduce", "nvlink", false, false, Capsule(NvlinkAllReduce)},
      {"ncclx_all_reduce_nvlink_watched", "all_reduce", "nvlink", false, true,
       Stages(NvlinkAllReducePrepare, NvlinkAllReduce)},
      {"ncclx_all_gather_nvlink", "all_gather", "nvlink", false, false, Capsule(NvlinkAllGather)},
      {"ncclx_all_gather_nvlink_watched", "all_gather", "nvlink", false, true,
       Stages(NvlinkAllGatherPrepare, NvlinkAllGather)},
      {"ncclx_all_to_all_nvlink", "all_to_all", "nvlink", false, false, Capsule(NvlinkAllToAll)},
      {"ncclx_all_to_all_nvlink_watched", "all_to_all", "nvlink", false, true,
       Stages(NvlinkAllToAllPrepare, NvlinkAllToAll)},
      {"ncclx_reduce_scatter_nvlink", "reduce_scatter", "nvlink", false, false, Capsule(NvlinkReduceScatter)},
      {"ncclx_reduce_scatter_nvlink_watched", "reduce_scatter", "nvlink", false, true,
       Stages(NvlinkReduceScatterPrepare, NvlinkReduceScatter)},
      {"ncclx_moe_combine_nvlink", "moe_combine", "nvlink", false, false, Capsule(NvlinkMoeCombine)},
      {"ncclx_moe_combine_nvlink_watched", "moe_combine", "nvlink", false, true,
       Stages(NvlinkMoeCombinePrepare, NvlinkMoeCombine)},
      {"ncclx_moe_dispatch_nvlink", "moe_dispatch", "nvlink", false, false, Capsule(NvlinkMoeDispatch)},
      {"ncclx_moe_dispatch_nvlink_watched", "moe_dispatch", "nvlink", false, true,
       Stages(NvlinkMoeDispatchPrepare, NvlinkMoeDispatch)},
      {"ncclx_moe_masked_dispatch_nvlink", "moe_masked_dispatch", "nvlink", false, false,
       Capsule(NvlinkMoeMaskedDispatch)},
      {"ncclx_moe_masked_dispatch_nvlink_watched", "moe_masked_dispatch", "nvlink", false, true,
       Stages(NvlinkMoeMaskedDispatchPrepare, NvlinkMoeMaskedDispatch)},
      {"ncclx_moe_masked_combine_nvlink", "moe_masked_combine", "nvlink", false, false,
       Capsule(NvlinkMoeMaskedCombine)},
      {"ncclx_moe_masked_combine_nvlink_watched", "moe_masked_combine", "nvlink", false, true,
       Stages(NvlinkMoeMaskedCombinePrepare, NvlinkMoeMaskedCombine)},
#ifdef JAX_NCCLX_TESTING
      {"ncclx_launch_probe", "launch_probe", "local", false, false, Capsule(LaunchProbe)},
#endif
      {"ncclx_moe_plan_sends", "moe_plan_sends", "local", false, false, Capsule(CudaMoePlanSends)},
      {"ncclx_moe_place_received", "moe_place_received", "local", false, false, Capsule(CudaMoePlaceReceived)},
      {"ncclx_take_rows", "take_rows", "local", false, false, Capsule(CudaTakeRows)},
      {"ncclx_expand_rows", "expand_rows", "local", false, false, Capsule(CudaExpandRows)},
      {"ncclx_encode_rows", "encode_rows", "local", false, false, Capsule(CudaEncodeRows)},
  };
}

}  // namespace
}  // namespace jax_ncclx

NB_MODULE(_ncclx_cuda, m) {
  namespace jn = jax_ncclx;
  m.def(
      "registrations",
      [] {
        nb::dict targets;
        for (const jn::Handler& handler : jn::Handlers()) targets[handler.target] = handler.capsule;
        return targets;
      },
      "FFI handler capsules of the CUDA backend, by target name.");
  m.def(
      "handler_table",
      [] {
        nb::list table;
        for (const jn::Handler& handler : jn::Handlers()) {
          table.append(nb::make_tuple(handler.op, handler.transport, handler.cmdbuf, handler.watched, handler.target));
        }
        return table;
      },
      "(op, transport, cmdbuf, watched, target) of every CUDA handler: what the lowering looks a target up by.\n"
      "transport: 'nccl', 'nvlink' or 'local' (no communication); cmdbuf: the NCCL handler marked command-buffer\n"
      "compatible; watched: with the prepare stage that refuses an execution on a failed communicator.");
  m.def("nccl_version", &jn::NcclVersion,
        "NCCL_VERSION_CODE of the NCCL library loaded at run time (e.g. 22809 for 2.28.9).");
  m.def(
      "nccl_build_version", [] { return NCCL_VERSION_CODE; },
      "NCCL_VERSION_CODE of the nccl.h this module was compiled against.");
  m.def("cuda_runtime_version", &jn::CudaRuntimeVersion,
        "Version of the CUDA runtime loaded at run time (e.g. 13000 for 13.0).");
  m.def("device_memory_used", &jn::DeviceMemoryUsed, nb::arg("device"),
        "Bytes in use on CUDA device `device` by every allocator (total - free, cudaMemGetInfo).");
  m.def("unique_id", &jn::UniqueId,
        "A new NCCL unique id (128 bytes). Create it on one process and pass it to init_comm on all.");
  m.def("register_comm", &jn::RegisterCommMembers, nb::arg("nranks"), nb::arg("ranks"), nb::arg("devices"),
        "Registers a communicator of nranks ranks whose local device devices[i] is rank ranks[i] (one clique\n"
        "per group of an axis) and returns its comm_id. Makes no NCCL call: the NVLink kernels need only the\n"
        "ranks; init_comm adds the NCCL communicators when an op needs them.");
  m.def("init_comm", &jn::InitComm, nb::arg("comm_id"), nb::arg("unique_ids"), nb::arg("max_ctas") = 0,
        "Creates the NCCL communicators of `comm_id`, one per local device, all in one NCCL group: each device\n"
        "joins its clique with unique_ids[device] (its group's ids: one, or one per root for NCCL's multi-root\n"
        "ncclCommInitRankScalable). Blocks (without the GIL) until every rank of every clique has joined.\n"
        "max_ctas > 0 caps NCCL's thread blocks (channels) per call (ncclConfig_t.maxCTAs). Raises\n"
        "RuntimeError with NCCL's message on failure.");
  m.def("comm_info", &jn::CommInfo, nb::arg("comm_id"),
        "The local ranks of `comm_id` as (device, rank, nranks) tuples, by device.");
  m.def("destroy_all", &jn::DestroyAll,
        "Frees all symmetric memory and destroys every communicator (aborted ones are gone already) and\n"
        "forgets their faults. Programs that use them must have finished; programs compiled with their\n"
        "comm_ids fail with an error afterwards.");
  m.def("connect_symmetric", &jn::ConnectSymmetricMemory, nb::arg("comm_id"), nb::arg("exchange"),
        "The first step of communicator `comm_id`'s symmetric memory, collective over every process holding\n"
        "its ranks: allocates each rank's control block, peer table and fault record, agrees on whether every\n"
        "rank reaches every peer through NVLink peer access, and maps the peers. Addresses travel through\n"
        "`exchange([(device, rank, bytes), ...])`, which returns for each entry the bytes of every rank of its\n"
        "group in rank order (collective; no NCCL call is made).\n"
        "Returns '' when the NVLink kernels can run on the communicator, else why not (the same answer on\n"
        "every rank; remembered, so later calls return at once).");
  m.def("grow_symmetric", &jn::GrowSymmetricMemory, nb::arg("comm_id"), nb::arg("staging_bytes"),
        nb::arg("parity_half_bytes"), nb::arg("exchange"),
        "Collective like connect_symmetric, on a communicator it found usable: makes every rank's data region\n"
        "hold at least `staging_bytes` of all_to_allv_dynamic staging and `parity_half_bytes` of low-latency\n"
        "slots per call parity (grown, never shrunk; nothing happens when it already does) and maps it into\n"
        "all peers. Raises RuntimeError if the communicator was not connected, cannot use NVLink, or the\n"
        "growth failed.");
  m.def("comm_memory", &jn::MemoryHeld,
        "Memory held per (communicator, local device): (comm_id, device, nccl_init_bytes, data_bytes,\n"
        "low_latency_bytes, control_bytes, pinned_host_bytes). nccl_init_bytes: device memory that\n"
        "ncclCommInitRank took (cudaMemGetInfo around it); the rest is jax_ncclx's symmetric memory, where\n"
        "low_latency_bytes is the part of data_bytes taken by the low-latency slots.");
  m.def("device_trace", &jn::DeviceTrace, nb::arg("comm_id"),
        "Device timelines of the traced NVLink kernel calls on communicator `comm_id` (the last 1024): per\n"
        "local rank (device, rank, [{epoch, start_ns, peers_ns, sent_ns, data_ns, end_ns, blocks,\n"
        "kernel, ready_ns}, ...]),\n"
        "oldest first, times from the GPU's %globaltimer. Waits for the local devices to go idle.");
  m.def(
      "nvlink_launch_counts",
      [] {
        const jn::NvlinkLaunchCounts counts = jn::GetNvlinkLaunchCounts();
        return std::make_tuple(counts.launches, counts.captured);
      },
      "(host launches, launches recorded into CUDA graphs) of every NVLink handler.");
  m.def("nvlink_collective_bytes", &jn::NvlinkCollectiveBytes, nb::arg("op"), nb::arg("algorithm"), nb::arg("protocol"),
        nb::arg("bytes"), nb::arg("size"), nb::arg("element_bytes"), nb::arg("direct"),
        "Low-latency slot bytes per call parity that the NVLink kernel of `op` ('all_reduce', 'all_gather',\n"
        "'all_to_all') needs for `bytes` of input per rank on `size` ranks; algorithm 1 one-shot, 2 two-shot;\n"
        "protocol (one-shot) 0 LL128, 1 LL, 2 simple; direct: the call writes into the peers' outputs where it\n"
        "can (two-shot: no all-gather slots; simple all_gather / all_to_all: no slots).");
  m.attr("MOE_COMBINE_MAX_TOP_K") = jn::kMaxMoeCombineTopK;
  m.def(
      "moe_combine_slot_bytes",
      [](int size, int64_t rows_per_member, int64_t hidden, int element_bytes) {
        if (size < 1 || size > jn::kMaxNvlinkRanks || rows_per_member < 0 || hidden < 0 || element_bytes < 1) {
          throw std::invalid_argument("moe_combine_slot_bytes: bad sizes");
        }
        return jn::MoeCombineSlotBytes(size, rows_per_member, hidden, element_bytes);
      },
      nb::arg("size"), nb::arg("rows_per_member"), nb::arg("hidden"), nb::arg("element_bytes"),
      "Low-latency slot bytes per call parity that moe.combine's NVLink kernel needs on `size` ranks for\n"
      "`rows_per_member` token rows per member of `hidden` elements of `element_bytes` each.");
  m.attr("MOE_DISPATCH_MAX_TOP_K") = jn::kMaxMoeDispatchTopK;
  m.attr("MOE_DISPATCH_MAX_PAIRS") = jn::kMaxMoeDispatchPairs;
  m.attr("MOE_DISPATCH_MAX_MEMBER_TOKENS") = jn::kMaxMoeDispatchMemberTokens;
  m.def(
      "moe_dispatch_slot_bytes",
      [](int size, int64_t rows_per_member, int top_k, int wire, int64_t wire_row_bytes, bool with_weights) {
        if (size < 1 || size > jn::kMaxNvlinkRanks || rows_per_member < 0 || top_k < 1 || wire_row_bytes < 0 ||
            !jn::ValidMoeWire(static_cast<jn::MoeWire>(wire))) {
          throw std::invalid_argument("moe_dispatch_slot_bytes: bad sizes or wire");
        }
        return jn::MoeDispatchSlotBytes(size, rows_per_member, top_k, static_cast<jn::MoeWire>(wire), wire_row_bytes,
                                        with_weights);
      },
      nb::arg("size"), nb::arg("rows_per_member"), nb::arg("top_k"), nb::arg("wire"), nb::arg("wire_row_bytes"),
      nb::arg("with_weights"),
      "Low-latency slot bytes per call parity that moe.dispatch's NVLink kernel needs on `size` ranks for\n"
      "`rows_per_member` token rows per member of `wire_row_bytes` bytes each on the wire `wire` (a\n"
      "contract.MOE_WIRES value; moe_dispatch_wire_row_bytes), with top-k tags (and weights).");
  m.def(
      "moe_dispatch_wire_row_bytes",
      [](int64_t hidden, int64_t element_bytes, int wire) {
        if (hidden < 0 || element_bytes < 1 || !jn::ValidMoeWire(static_cast<jn::MoeWire>(wire))) {
          throw std::invalid_argument("moe_dispatch_wire_row_bytes: bad sizes or wire");
        }
        return jn::MoeDispatchWireRowBytes(hidden, element_bytes, static_cast<jn::MoeWire>(wire));
      },
      nb::arg("hidden"), nb::arg("element_bytes"), nb::arg("wire"),
      "Bytes of a token row of `hidden` elements of `element_bytes` each on moe.dispatch's wire (a\n"
      "contract.MOE_WIRES value): as they are, or on an 8-bit wire hidden bytes and a float32 scale per\n"
      "MOE_WIRE_BLOCK values (one for the row where hidden is not a multiple of it).");
  m.attr("MOE_MASKED_MAX_TOP_K") = jn::kMaxMoeMaskedTopK;
  m.attr("MOE_MASKED_MAX_PAIRS") = jn::kMaxMoeMaskedPairs;
  m.attr("MOE_LINES_MAX_BYTES") = jn::kMoeLinesMaxBytes;  // slot rows up to which the MoE kernels send lines
  m.def(
      "moe_masked_dispatch_slot_bytes",
      [](int size, int64_t tokens, int64_t local_experts, int64_t capacity, int wire, int64_t wire_row_bytes) {
        if (size < 1 || size > jn::kMaxNvlinkRanks || tokens < 0 || local_experts < 0 || capacity < 0 ||
            wire_row_bytes < 0 || !jn::ValidMoeWire(static_cast<jn::MoeWire>(wire))) {
          throw std::invalid_argument("moe_masked_dispatch_slot_bytes: bad sizes or wire");
        }
        return jn::MoeMaskedDispatchSlotBytes(size, tokens, local_experts, capacity, static_cast<jn::MoeWire>(wire),
                                              wire_row_bytes);
      },
      nb::arg("size"), nb::arg("tokens"), nb::arg("local_experts"), nb::arg("capacity"), nb::arg("wire"),
      nb::arg("wire_row_bytes"),
      "Low-latency slot bytes per call parity that the masked dispatch's NVLink kernel needs on `size` ranks\n"
      "for `tokens` tokens per rank and `local_experts` experts per rank of `capacity` rows per source, a row\n"
      "of `wire_row_bytes` bytes on the wire `wire` (a contract.MOE_WIRES value; moe_dispatch_wire_row_bytes):\n"
      "the counts and the pair map, then each source's token rows.");
  m.def(
      "moe_masked_combine_slot_bytes",
      [](int64_t pairs, int64_t hidden, int element_bytes) {
        if (pairs < 0 || hidden < 0 || element_bytes < 1) {
          throw std::invalid_argument("moe_masked_combine_slot_bytes: bad sizes");
        }
        return jn::MoeMaskedCombineSlotBytes(pairs, hidden, element_bytes);
      },
      nb::arg("pairs"), nb::arg("hidden"), nb::arg("element_bytes"),
      "Low-latency slot bytes per call parity that the masked combine's NVLink kernel needs for `pairs`\n"
      "(token, choice) pairs per rank and rows of `hidden` elements of `element_bytes` each (past the LL areas of\n"
      "the largest communicator: the same on any number of ranks).");
  jn::DefineMonitorBindings(m, jn::ResolveCallRecord, jn::ResetTraceAnchors);
  jn::DefineContractBindings(m);
  m.def(
      "faults",
      [] {
        std::vector<std::tuple<int64_t, std::string>> faults;
        {
          nb::gil_scoped_release release;
          jn::RecordNvlinkFaults();
          for (auto& [comm_id, message] : jn::CommFaults()) faults.emplace_back(comm_id, std::move(message));
        }
        return faults;
      },
      "Communicators that stopped working, as (comm_id, message): NCCL calls the watchdog aborted and NVLink\n"
      "kernels that gave up waiting for a peer.");
  m.def(
      "watchdog_state",
      [] {
        jn::WatchdogState state = jn::GetWatchdogState();
        std::vector<std::tuple<int64_t, int64_t>> unnamed(state.unnamed.begin(), state.unnamed.end());
        return std::make_tuple(state.reached, unnamed, state.late);
      },
      "([(comm_id, rank, highest sequence queued)] of the local ranks' watched NCCL calls,\n"
      " [(comm_id, sequence)] of hung calls whose missing ranks are in other processes,\n"
      " [(comm_id, sequence, description)] of each communicator's latest call that finished only after half\n"
      " its timeout).");
  m.def(
      "watch_now",
      [] {
        nb::gil_scoped_release release;
        jn::WatchNow();
      },
      "Runs one watchdog pass on this thread: calls that finished or timed out are seen at once.");
  m.def(
      "abort_comm",
      [](int64_t comm_id, std::string message) {
        nb::gil_scoped_release release;
        jn::AbortComm(comm_id, std::move(message));
      },
      nb::arg("comm_id"), nb::arg("message"),
      "Records `message` as communicator `comm_id`'s fault and stops its local NCCL communicators (abort, or\n"
      "revoke when CUDA graphs hold calls on them).");
  m.def(
      "stop_watchdog",
      [] {
        nb::gil_scoped_release release;
        jn::StopWatchdog();
      },
      "Stops the watchdog thread (at interpreter exit); it restarts with the next watched call.");
  m.def("set_watch_replays", &jn::SetWatchReplays, nb::arg("watch"),
        "Whether NCCL calls captured into CUDA graphs from now on are watched in their replays\n"
        "(JAX_NCCLX_WATCH_REPLAYS; xla_ffi/common/replay_watch.h).");
  m.def("all_to_allv_workspace_bytes", &jn::AllToAllvWorkspaceBytes, nb::arg("batch"), nb::arg("num_peers"),
        nb::arg("num_chunks"), nb::arg("capacity"), nb::arg("row_bytes"), nb::arg("received_apart"),
        "Bytes of the NCCL path's workspace for an exchange of `batch` x `num_peers` x `capacity` rows of\n"
        "`row_bytes` (received_apart: the packed layout and placed calls, which receive rows apart).");
  m.def("moe_plan_sends_scratch_bytes", &jn::PlanSendsScratch, nb::arg("batch"), nb::arg("num_tokens"),
        nb::arg("num_members"), "Bytes of device scratch that moe's plan_sends kernel takes.");
  m.def("all_to_allv_symmetric_bytes", &jn::AllToAllvSymmetricBytes, nb::arg("batch"), nb::arg("num_peers"),
        nb::arg("num_chunks"), nb::arg("capacity"), nb::arg("row_bytes"), nb::arg("direct"),
        "(staging bytes, low-latency bytes per call parity) the NVLink all_to_allv_dynamic kernel needs for\n"
        "these static sizes: the rows' staging slots (none when `direct`: ranks write into each other's\n"
        "outputs, one process) and the count slots.");
}
