// _ncclx_loopback, a test-only module: runs the NVLink kernels with 2 to 8 ranks on ONE GPU, so their
// protocols (epoch flags, LL words, LL128 lines, direct writes into the peers' outputs, count slots, the
// patience that names a missing rank) are tested on machines with a single GPU.
//
// Each logical rank gets what symmetric.cc gives a real one: a zeroed control block, a zeroed data region
// (two low-latency halves, then the all_to_allv_dynamic staging area), a peer table and a fault record in
// mapped pinned memory. Here they all live on the current device, and every rank has its own stream. The
// calls are queued call-major (call c of every rank before call c + 1 of any), so the ranks' kernels run
// side by side as on separate GPUs and a full launch queue cannot hold back a call that others wait on.
// Block counts are chosen as if the GPU had SMs / ranks SMs, so every block of every rank is resident at once
// (blocks wait for their peers' blocks). A run may leave one rank out (its peers must give up and name it) or
// start one rank's every call late (its peers run into the next call's parity half while it still reads the
// last one's).
//
// Not covered: NVLink itself, CUDA IPC between processes, the FFI handlers and XLA (the multi-GPU suites).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/symmetric_layout.h"
#include "common/trace_bindings.h"
#include "ops/all_to_allv/all_to_allv_kernels.h"
#include "ops/moe/moe_combine.h"
#include "ops/moe/moe_dispatch.h"
#include "ops/moe/moe_masked.h"
#include "ops/collectives/nvlink_collectives_kernels.h"

namespace nb = nanobind;

namespace jax_ncclx {
namespace {

void Check(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error("nvlink_loopback: " + what + ": " + cudaGetErrorString(status));
}

void Require(bool ok, const std::string& problem) {
  if (!ok) throw std::invalid_argument("nvlink_loopback: " + problem);
}

int64_t Align256(int64_t bytes) { return std::max<int64_t>(256, (bytes + 255) / 256 * 256); }

// Everything one run allocates, released together once the device is idle (also when a run throws).
class Resources {
 public:
  Resources() = default;
  Resources(const Resources&) = delete;
  Resources& operator=(const Resources&) = delete;
  ~Resources() {
    cudaDeviceSynchronize();
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    for (cudaEvent_t event : events_) cudaEventDestroy(event);
    for (cudaStream_t stream : streams_) cudaStreamDestroy(stream);
    for (void* ptr : device_) cudaFree(ptr);
    for (void* ptr : host_) cudaFreeHost(ptr);
    cudaGetLastError();
  }

  // Device memory with every byte set to `fill` (an empty request still gets a valid pointer).
  template <typename T>
  T* Filled(int64_t bytes, int fill, const std::string& what) {
    void* ptr = nullptr;
    Check(cudaMalloc(&ptr, std::max<int64_t>(bytes, 1)), "cudaMalloc (" + what + ")");
    device_.push_back(ptr);
    Check(cudaMemset(ptr, fill, std::max<int64_t>(bytes, 1)), "cudaMemset (" + what + ")");
    return static_cast<T*>(ptr);
  }

  NvlinkFault* MappedFault() {
    void* ptr = nullptr;
    Check(cudaHostAlloc(&ptr, sizeof(NvlinkFault), cudaHostAllocMapped), "cudaHostAlloc (fault record)");
    host_.push_back(ptr);
    std::memset(ptr, 0, sizeof(NvlinkFault));
    return static_cast<NvlinkFault*>(ptr);
  }

  cudaStream_t Stream() {
    cudaStream_t stream = nullptr;
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    streams_.push_back(stream);
    return stream;
  }

  cudaEvent_t Event() {
    cudaEvent_t event = nullptr;
    Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    events_.push_back(event);
    return event;
  }

  void KeepGraph(cudaGraph_t graph, cudaGraphExec_t exec) {
    graph_ = graph;
    exec_ = exec;
  }

 private:
  std::vector<void*> device_;
  std::vector<void*> host_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The logical ranks of one communicator on the current device.
struct Ranks {
  int size = 0;
  std::vector<SymmetricControl*> control;
  std::vector<NvlinkFault*> fault;  // host view of each rank's fault record
  std::vector<const PeerTable*> table;
  std::vector<cudaStream_t> stream;

  Ranks(Resources& resources, int ranks, int64_t parity_half_bytes, int64_t staging_bytes) : size(ranks) {
    std::vector<uint8_t*> data(size);
    for (int r = 0; r < size; ++r) {
      control.push_back(resources.Filled<SymmetricControl>(sizeof(SymmetricControl), 0, "control block"));
      data[r] = resources.Filled<uint8_t>(2 * parity_half_bytes + staging_bytes, 0, "data region");
      fault.push_back(resources.MappedFault());
      stream.push_back(resources.Stream());
    }
    for (int r = 0; r < size; ++r) {
      PeerTable peers = {};
      for (int p = 0; p < size; ++p) {
        peers.data[p] = data[p];
        peers.control[p] = control[p];
      }
      peers.parity_half_bytes = parity_half_bytes;
      void* fault_on_device = nullptr;
      Check(cudaHostGetDevicePointer(&fault_on_device, fault[r], 0), "cudaHostGetDevicePointer");
      peers.fault = static_cast<NvlinkFault*>(fault_on_device);
      PeerTable* on_device = resources.Filled<PeerTable>(sizeof(PeerTable), 0, "peer table");
      Check(cudaMemcpy(on_device, &peers, sizeof(PeerTable), cudaMemcpyHostToDevice), "cudaMemcpy (peer table)");
      table.push_back(on_device);
    }
  }
};

// One operand of a call, for every rank and call: [slots, ranks, bytes] on the device, where slot c < calls
// holds call c and, in graph mode, the extra last slot is what the recorded graph reads and writes.
struct Operand {
  std::string name;
  int64_t bytes = 0;  // per rank and call
  bool output = false;
  uint8_t* device = nullptr;

  uint8_t* At(int slot, int rank, int size) const { return device + (int64_t{slot} * size + rank) * bytes; }
};

// What a run tells the test: the outputs (bytes of [calls, ranks, ...]) and each rank's end state.
struct Outcome {
  std::vector<nb::bytes> outputs;
  std::vector<nb::dict> ranks;
};

// Outputs start as this byte, so a result the kernels never wrote shows.
constexpr int kUnwritten = 0xA5;

// How the calls of a run are issued.
struct Schedule {
  int calls = 1;
  bool graph = false;  // one call of every rank recorded into a CUDA graph, replayed `calls` times
  int absent = -1;     // a rank that never launches (-1: none)
  int late = -1;       // a rank whose stream sleeps `late_us` on the host before each of its calls (-1: none)
  int64_t late_us = 0;
  int64_t timeout_ms = 0;  // how long a kernel waits for a peer
};

void CheckSchedule(int size, const Schedule& schedule) {
  Require(size >= 1 && size <= kMaxNvlinkRanks,
          "size is " + std::to_string(size) + ", expected 1.." + std::to_string(kMaxNvlinkRanks));
  Require(schedule.calls >= 1, "calls is " + std::to_string(schedule.calls) + ", expected >= 1");
  Require(schedule.absent >= -1 && schedule.absent < size,
          "absent is " + std::to_string(schedule.absent) + ", expected -1 or a rank");
  Require(schedule.late >= -1 && schedule.late < size && schedule.late_us >= 0,
          "late is " + std::to_string(schedule.late) + " and late_us " + std::to_string(schedule.late_us) +
              ", expected -1 or a rank, and a delay >= 0");
  // A wait without a deadline would hang the test process if a kernel never saw its peer.
  Require(schedule.timeout_ms > 0, "timeout_ms is " + std::to_string(schedule.timeout_ms) + ", expected > 0");
}

void CUDART_CB SleepOnHost(void* microseconds) {
  std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<const int64_t*>(microseconds)));
}

// A rank's device timeline (DeviceTraceRecord) of its traced calls, oldest first: one dict per call with the
// record's fields, times in %globaltimer nanoseconds (one clock for every rank of this GPU).
nb::list TraceOf(const SymmetricControl* control) {
  std::vector<DeviceTraceRecord> ring(kTraceSlots);
  Check(cudaMemcpy(ring.data(), control->trace, sizeof(DeviceTraceRecord) * kTraceSlots, cudaMemcpyDeviceToHost),
        "cudaMemcpy (trace)");
  std::vector<DeviceTraceRecord> records;
  for (int slot = 0; slot < kTraceSlots; ++slot) {
    if (IsCompleteTraceRecord(ring[slot], slot)) records.push_back(ring[slot]);
  }
  std::sort(records.begin(), records.end(),
            [](const DeviceTraceRecord& a, const DeviceTraceRecord& b) { return a.epoch < b.epoch; });
  nb::list timeline;
  for (const DeviceTraceRecord& record : records) timeline.append(TraceRecordDict(record));
  return timeline;
}

// Records one call of every rank into a CUDA graph, on streams forked from rank 0's, with the operands of the
// extra last slot, then replays it once per call: before each replay that call's inputs are copied into the
// slot (and its outputs reset), after it its outputs are copied out.
void ReplayAsGraph(Resources& resources, const Ranks& ranks, const std::vector<Operand>& operands, int calls,
                   const std::function<void(int, int)>& issue) {
  const int size = ranks.size;
  const int fixed = calls;
  cudaStream_t origin = ranks.stream[0];
  cudaEvent_t forked = resources.Event();
  std::vector<cudaEvent_t> joined(size);
  for (cudaEvent_t& event : joined) event = resources.Event();
  cudaGraph_t recorded = nullptr;
  Check(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  Check(cudaEventRecord(forked, origin), "cudaEventRecord");
  for (int rank = 0; rank < size; ++rank) {
    if (rank != 0) Check(cudaStreamWaitEvent(ranks.stream[rank], forked), "cudaStreamWaitEvent");
    issue(rank, fixed);
    if (rank == 0) continue;
    Check(cudaEventRecord(joined[rank], ranks.stream[rank]), "cudaEventRecord");
    Check(cudaStreamWaitEvent(origin, joined[rank]), "cudaStreamWaitEvent");
  }
  Check(cudaStreamEndCapture(origin, &recorded), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, recorded, 0);
  resources.KeepGraph(recorded, exec);
  Check(instantiated, "cudaGraphInstantiate");
  for (int call = 0; call < calls; ++call) {
    for (const Operand& operand : operands) {
      const int64_t bytes = int64_t{size} * operand.bytes;
      if (operand.output) {
        Check(cudaMemsetAsync(operand.At(fixed, 0, size), kUnwritten, bytes, origin), "cudaMemsetAsync");
      } else {
        Check(cudaMemcpyAsync(operand.At(fixed, 0, size), operand.At(call, 0, size), bytes, cudaMemcpyDeviceToDevice,
                              origin),
              "cudaMemcpyAsync (inputs in)");
      }
    }
    Check(cudaGraphLaunch(exec, origin), "cudaGraphLaunch");
    for (const Operand& operand : operands) {
      if (!operand.output) continue;
      Check(cudaMemcpyAsync(operand.At(call, 0, size), operand.At(fixed, 0, size), int64_t{size} * operand.bytes,
                            cudaMemcpyDeviceToDevice, origin),
            "cudaMemcpyAsync (outputs out)");
    }
  }
}

// Runs the schedule's calls. `launch(rank, slot, stream)` queues one rank's kernel on the operands of `slot`.
// Inputs come from `host_inputs` (one per input operand, in order, each [calls, ranks, bytes]). As a graph,
// the kernels' arguments stay fixed and only the epochs on the device advance.
Outcome Run(Resources& resources, const Ranks& ranks, std::vector<Operand>& operands,
            const std::vector<const nb::bytes*>& host_inputs, const Schedule& schedule,
            const std::function<cudaError_t(int, int, cudaStream_t)>& launch) {
  const int size = ranks.size;
  const int calls = schedule.calls;
  const bool graph = schedule.graph;
  const int slots = calls + (graph ? 1 : 0);
  size_t next_input = 0;
  for (Operand& operand : operands) {
    const int64_t total = int64_t{slots} * size * operand.bytes;
    operand.device = resources.Filled<uint8_t>(total, operand.output ? kUnwritten : 0, operand.name);
    if (operand.output) continue;
    const nb::bytes& given = *host_inputs.at(next_input++);
    Require(static_cast<int64_t>(given.size()) == int64_t{calls} * size * operand.bytes,
            operand.name + " has " + std::to_string(given.size()) + " bytes, expected calls (" + std::to_string(calls) +
                ") x ranks (" + std::to_string(size) + ") x " + std::to_string(operand.bytes));
    Check(cudaMemcpy(operand.device, given.c_str(), given.size(), cudaMemcpyHostToDevice),
          "cudaMemcpy (" + operand.name + ")");
  }

  // The set-up above ran on the legacy default stream, which the ranks' non-blocking streams do not wait for
  // (a late memset of an output once overwrote what a kernel had written).
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (set-up)");
  // One rank's call as the schedule has it: late or absent.
  const std::function<void(int, int)> issue = [&](int rank, int slot) {
    if (rank == schedule.absent) return;
    cudaStream_t stream = ranks.stream[rank];
    if (rank == schedule.late) {
      Check(cudaLaunchHostFunc(stream, SleepOnHost, const_cast<int64_t*>(&schedule.late_us)), "cudaLaunchHostFunc");
    }
    Check(launch(rank, slot, stream), "kernel launch");
  };
  if (!graph) {
    for (int call = 0; call < calls; ++call) {
      for (int rank = 0; rank < size; ++rank) issue(rank, call);
    }
  } else {
    ReplayAsGraph(resources, ranks, operands, calls, issue);
  }
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  Outcome outcome;
  for (const Operand& operand : operands) {
    if (!operand.output) continue;
    std::string host(static_cast<size_t>(int64_t{calls} * size * operand.bytes), '\0');
    Check(cudaMemcpy(host.data(), operand.device, host.size(), cudaMemcpyDeviceToHost),
          "cudaMemcpy (" + operand.name + ")");
    outcome.outputs.emplace_back(host.data(), host.size());
  }
  for (int rank = 0; rank < size; ++rank) {
    uint64_t finished = 0;
    Check(cudaMemcpy(&finished, &ranks.control[rank]->epoch, sizeof(finished), cudaMemcpyDeviceToHost),
          "cudaMemcpy (epoch)");
    NvlinkFault fault;  // the kernels are done: a plain copy of the mapped record is complete
    std::memcpy(&fault, ranks.fault[rank], sizeof(fault));
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (fault.missing[r] != 0) missing.push_back(r);
    }
    nb::dict state;
    state["calls_finished"] = finished;
    state["trace"] = TraceOf(ranks.control[rank]);
    state["fault"] = fault.state == kNvlinkHealthy ? "healthy" : fault.state == kNvlinkGaveUp ? "gave_up" : "aborted";
    state["fault_call"] = fault.epoch;
    state["aborted_by"] = static_cast<int>(fault.aborted_by) - 1;
    state["missing"] = missing;
    outcome.ranks.push_back(state);
  }
  return outcome;
}

// SMs a rank may fill: the GPU's share of each rank.
int SmsPerRank(int size) {
  int device = 0;
  int sms = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return std::max(1, sms / size);
}

nb::dict ToDict(Outcome outcome, const std::vector<std::string>& names, int blocks) {
  nb::dict result;
  for (size_t i = 0; i < names.size(); ++i) result[names[i].c_str()] = outcome.outputs[i];
  result["ranks"] = outcome.ranks;
  result["blocks"] = blocks;
  return result;
}

nb::dict Collective(const std::string& op, const nb::bytes& x, int size, int calls, int64_t bytes, int element_bytes,
                    int algorithm, int protocol, int reduce_op, int reduce_type, bool direct, int blocks, bool trace,
                    bool graph, int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  NvlinkCollectiveArgs args;
  const std::optional<NvlinkCollective> named = NvlinkCollectiveNamed(op);
  Require(named.has_value(), "op is '" + op + "', expected all_reduce, all_gather, all_to_all or reduce_scatter");
  args.op = *named;
  Require(algorithm == 1 || (algorithm == 2 && args.op == NvlinkCollective::kAllReduce),
          "algorithm is " + std::to_string(algorithm) + ", expected 1 (one-shot) or, for all_reduce, 2 (two-shot)");
  Require(protocol >= 0 && protocol <= 2, "protocol is " + std::to_string(protocol) + ", expected 0, 1 or 2");
  Require(reduce_op >= 0 && reduce_op <= 2, "reduce_op is " + std::to_string(reduce_op) + ", expected 0, 1 or 2");
  Require(reduce_type >= 0 && reduce_type <= 3, "reduce_type is " + std::to_string(reduce_type) + ", expected 0..3");
  Require(element_bytes >= 1 && bytes > 0 && bytes % element_bytes == 0,
          "bytes per rank (" + std::to_string(bytes) + ") must be a positive multiple of element_bytes (" +
              std::to_string(element_bytes) + ")");
  Require(!SendsBlocks(args.op) || bytes % (int64_t{size} * element_bytes) == 0,
          op + " needs bytes per rank (" + std::to_string(bytes) + ") to split into " + std::to_string(size) +
              " blocks of whole elements");
  args.algorithm = static_cast<NvlinkAlgorithm>(algorithm);
  args.reduce = static_cast<ReduceOp>(reduce_op);
  args.reduce_type = static_cast<ReduceType>(reduce_type);
  args.protocol = static_cast<NvlinkProtocol>(protocol);
  args.element_bytes = element_bytes;
  args.size = size;
  args.bytes = bytes;
  args.direct = direct;
  args.trace = trace;
  args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
  const int64_t slot_bytes = NvlinkCollectiveSlotBytes(args.op, args.algorithm, args.protocol, bytes, size,
                                                       element_bytes, direct);
  const int grid = ChooseNvlinkCollectiveBlocks(args, blocks, SmsPerRank(size));

  Resources resources;
  Ranks ranks(resources, size, Align256(slot_bytes), 0);
  const int64_t y_bytes = args.op == NvlinkCollective::kAllGather       ? bytes * size
                          : args.op == NvlinkCollective::kReduceScatter ? bytes / size
                                                                        : bytes;
  std::vector<Operand> operands = {{"x", bytes, false}, {"y", y_bytes, true}};
  Outcome outcome = Run(resources, ranks, operands, {&x}, schedule, [&](int rank, int slot, cudaStream_t stream) {
    NvlinkCollectiveArgs mine = args;
    mine.rank = rank;
    mine.site = rank;
    mine.table = ranks.table[rank];
    mine.control = ranks.control[rank];
    mine.x = operands[0].At(slot, rank, size);
    mine.y = operands[1].At(slot, rank, size);
    return LaunchNvlinkCollective(mine, grid, stream);
  });
  return ToDict(std::move(outcome), {"y"}, grid);
}

nb::dict AllToAllv(const nb::bytes& x, const nb::bytes& counts, const std::optional<nb::bytes>& send_rows,
                   const std::optional<nb::bytes>& suffix, const std::optional<nb::bytes>& place, int size, int calls,
                   int64_t batch, int64_t source_rows, int64_t num_rows, int64_t num_chunks, int64_t capacity,
                   int64_t row_bytes, int64_t suffix_bytes, int64_t out_rows, bool packed, bool direct, int blocks,
                   bool trace, bool graph, int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  Require(batch >= 1 && source_rows >= 0 && num_rows >= 0 && num_chunks >= 1 && capacity >= 0 && row_bytes > 0,
          "bad sizes: batch, chunks and row_bytes must be positive; rows and capacity non-negative");
  Require(suffix_bytes >= 0 && suffix_bytes <= row_bytes && suffix.has_value() == (suffix_bytes > 0),
          "suffix_bytes must be in [0, row_bytes], and positive exactly when a suffix is given");
  Require(send_rows.has_value() || num_rows == source_rows, "without send_rows, num_rows must equal source_rows");
  Require(!place.has_value() || (!packed && out_rows >= 0), "a place table needs the padded layout and out_rows");
  AllToAllvShape shape;
  shape.batch = batch;
  shape.num_peers = size;
  shape.num_chunks = num_chunks;
  shape.num_rows = num_rows;
  shape.source_rows = source_rows;
  shape.capacity = capacity;
  shape.row_bytes = row_bytes;
  shape.suffix_bytes = suffix_bytes;
  const NvlinkAllToAllvLayout layout = LayOutNvlinkAllToAllv(shape, direct);
  int per_sm = 0;
  Check(NvlinkAllToAllvBlocksPerSm(&per_sm), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int sms = SmsPerRank(size);
  const NvlinkGrid grid = ChooseNvlinkGrid(shape, direct, blocks, sms, sms * per_sm);

  Resources resources;
  Ranks ranks(resources, size, Align256(layout.counts_bytes), layout.staging_bytes);
  std::vector<Operand> operands = {
      {"x", batch * source_rows * (row_bytes - suffix_bytes), false},
      {"counts", batch * size * num_chunks * int64_t{sizeof(int32_t)}, false},
      {"y", batch * (place ? out_rows : size * capacity) * row_bytes, true},
      {"recv_counts", batch * size * num_chunks * int64_t{sizeof(int32_t)}, true},
      {"dropped", batch * size * int64_t{sizeof(int32_t)}, true},
  };
  std::vector<const nb::bytes*> inputs = {&x, &counts};
  const int send_rows_operand = send_rows ? static_cast<int>(operands.size()) : -1;
  if (send_rows) {
    operands.push_back({"send_rows", batch * num_rows * int64_t{sizeof(int32_t)}, false});
    inputs.push_back(&*send_rows);
  }
  const int suffix_operand = suffix ? static_cast<int>(operands.size()) : -1;
  if (suffix) {
    operands.push_back({"suffix", batch * num_rows * suffix_bytes, false});
    inputs.push_back(&*suffix);
  }
  const int place_operand = place ? static_cast<int>(operands.size()) : -1;
  if (place) {
    operands.push_back({"place", batch * size * capacity * int64_t{sizeof(int32_t)}, false});
    inputs.push_back(&*place);
  }
  Outcome outcome = Run(resources, ranks, operands, inputs, schedule, [&](int rank, int slot, cudaStream_t stream) {
    NvlinkAllToAllvArgs args;
    args.shape = shape;
    args.rank = rank;
    args.groups = grid.groups;
    args.rounds = grid.rounds;
    args.packed = packed;
    args.direct = direct;
    args.trace = trace;
    args.site = rank;
    args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
    args.x = operands[0].At(slot, rank, size);
    args.counts = reinterpret_cast<const int32_t*>(operands[1].At(slot, rank, size));
    args.y = operands[2].At(slot, rank, size);
    args.recv_counts = reinterpret_cast<int32_t*>(operands[3].At(slot, rank, size));
    args.dropped = reinterpret_cast<int32_t*>(operands[4].At(slot, rank, size));
    if (send_rows_operand >= 0) {
      args.send_rows = reinterpret_cast<const int32_t*>(operands[send_rows_operand].At(slot, rank, size));
    }
    if (suffix_operand >= 0) args.suffix = operands[suffix_operand].At(slot, rank, size);
    if (place_operand >= 0) {
      args.place = reinterpret_cast<const int32_t*>(operands[place_operand].At(slot, rank, size));
      args.out_rows = out_rows;
    }
    args.table = ranks.table[rank];
    args.control = ranks.control[rank];
    args.counts_slot_bytes = layout.counts_slot_bytes;
    args.rows_slot_bytes = layout.rows_slot_bytes;
    return LaunchNvlinkAllToAllv(args, grid.blocks, stream);
  });
  return ToDict(std::move(outcome), {"y", "recv_counts", "dropped"}, grid.blocks);
}

nb::dict MoeCombine(const nb::bytes& expert_out, const nb::bytes& row_pairs, const nb::bytes& weights,
                    const nb::bytes& recv_tokens, const nb::bytes& return_row, int size, int calls, int type,
                    int64_t expert_rows, int64_t rows_per_member, int top_k, int64_t tokens, int64_t hidden, int blocks,
                    bool trace, bool graph, int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  Require(type >= 0 && type <= 2, "type is " + std::to_string(type) + ", expected 0 (f32), 1 (bf16) or 2 (f16)");
  const int element_bytes = FloatTypeBytes(static_cast<FloatType>(type));
  Require(expert_rows >= 0 && rows_per_member >= 0 && top_k >= 1 && top_k <= kMaxMoeCombineTopK && tokens >= 0 &&
              hidden >= 0 && hidden * element_bytes % 16 == 0,
          "bad sizes: rows, tokens and hidden must be non-negative, top_k positive, rows a multiple of 16 bytes");
  MoeCombineArgs args;
  args.type = static_cast<FloatType>(type);
  args.size = size;
  args.top_k = top_k;
  args.rows_per_member = rows_per_member;
  args.expert_rows = expert_rows;
  args.tokens = tokens;
  args.hidden = hidden;
  args.trace = trace;
  args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
  const int grid = ChooseMoeCombineBlocks(args, blocks, SmsPerRank(size));
  Resources resources;
  Ranks ranks(resources, size, MoeCombineSlotBytes(size, rows_per_member, hidden, element_bytes), 0);
  const int64_t received = int64_t{size} * rows_per_member;
  std::vector<Operand> operands = {
      {"expert_out", expert_rows * hidden * element_bytes, false},
      {"row_pairs", received * top_k * int64_t{sizeof(int32_t)}, false},
      {"weights", received * top_k * int64_t{sizeof(float)}, false},
      {"recv_tokens", size * int64_t{sizeof(int32_t)}, false},
      {"return_row", tokens * size * int64_t{sizeof(int32_t)}, false},
      {"out", tokens * hidden * element_bytes, true},
  };
  Outcome outcome = Run(resources, ranks, operands, {&expert_out, &row_pairs, &weights, &recv_tokens, &return_row},
                        schedule, [&](int rank, int slot, cudaStream_t stream) {
                          MoeCombineArgs mine = args;
                          mine.rank = rank;
                          mine.site = rank;
                          mine.expert_out = operands[0].At(slot, rank, size);
                          mine.row_pairs = reinterpret_cast<const int32_t*>(operands[1].At(slot, rank, size));
                          mine.weights = reinterpret_cast<const float*>(operands[2].At(slot, rank, size));
                          mine.recv_tokens = reinterpret_cast<const int32_t*>(operands[3].At(slot, rank, size));
                          mine.return_row = reinterpret_cast<const int32_t*>(operands[4].At(slot, rank, size));
                          mine.out = operands[5].At(slot, rank, size);
                          mine.table = ranks.table[rank];
                          mine.control = ranks.control[rank];
                          return LaunchMoeCombine(mine, grid, stream);
                        });
  nb::dict result = ToDict(std::move(outcome), {"out"}, grid);
  result["lines"] = MoeCombineUsesLines(size, rows_per_member, hidden * element_bytes);
  return result;
}

// moe.dispatch's results, in the order MoeDispatch returns them (and the FFI handler's results but the rows).
constexpr const char* kMoeDispatchResults[] = {"expert_rows",    "group_sizes",     "order",           "send_counts",
                                               "recv_counts",    "to_expert_major", "to_source_major", "return_slot",
                                               "dropped",        "send_token",      "token_counts",    "return_row",
                                               "recv_tokens",    "expand_rows",     "pair_entry",      "row_pairs",
                                               "send_back_rows", "recv_weights"};

// Adds the last call's phase clocks (each call overwrites them; `count` of them, [size, blocks, phases]) to a
// run's result: 'phase_clocks' (int64 bytes), 'phase_names' and 'clock_khz'.
template <size_t kPhases>
void AddPhaseClocks(nb::dict& result, const int64_t* clocks, int64_t count, const char* const (&names)[kPhases]) {
  std::string host(static_cast<size_t>(count * 8), '\0');
  Check(cudaMemcpy(host.data(), clocks, host.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (phase clocks)");
  int device = 0, clock_khz = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  Check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device), "cudaDeviceGetAttribute (clock rate)");
  nb::list listed;
  for (const char* name : names) listed.append(name);
  result["phase_clocks"] = nb::bytes(host.data(), host.size());
  result["phase_names"] = listed;
  result["clock_khz"] = clock_khz;
}

nb::dict MoeDispatch(const nb::bytes& tokens, const nb::bytes& expert_ids, const nb::bytes& weights, int size,
                     int calls, int64_t num_tokens, int64_t row_bytes, int top_k, int64_t num_experts, int64_t capacity,
                     bool with_weights, int wire, int type, int blocks, bool trace, bool phases, bool graph,
                     int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  Require(num_tokens >= 1 && top_k >= 1 && top_k <= kMaxMoeDispatchTopK && row_bytes >= 0 && row_bytes % 16 == 0 &&
              num_tokens * top_k <= kMaxMoeDispatchPairs && size * num_tokens <= kMaxMoeDispatchMemberTokens,
          "bad sizes: tokens and top_k positive within the kernel's limits, rows a multiple of 16 bytes");
  Require(wire >= 0 && wire <= 2, "wire is " + std::to_string(wire) + ", expected 0 (none), 1 (e4m3) or 2 (e5m2)");
  Require(type >= 0 && type <= 2, "type is " + std::to_string(type) + ", expected 0 (f32), 1 (bf16) or 2 (f16)");
  const MoeWire on = static_cast<MoeWire>(wire);
  const int64_t element_bytes = FloatTypeBytes(static_cast<FloatType>(type)), hidden = row_bytes / element_bytes;
  const int64_t wire_row_bytes = on == MoeWire::kNone ? row_bytes : MoeDispatchWireRowBytes(hidden, element_bytes, on);
  Require(on == MoeWire::kNone || (hidden % kMoeWireBlock == 0 && wire_row_bytes % 16 == 0),
          "bad sizes: an 8-bit wire takes rows of a multiple of the wire block");
  Require(num_experts >= 1 && num_experts % size == 0 && num_experts <= kMaxRoutingExperts && capacity >= 1,
          "bad sizes: num_experts a multiple of size up to the routing's limit, capacity positive");
  MoeDispatchArgs args;
  args.size = size;
  args.top_k = top_k;
  args.tokens = num_tokens;
  args.num_experts = num_experts;
  args.capacity = capacity;
  args.row_bytes = row_bytes;
  args.wire = on;
  args.token_type = static_cast<FloatType>(type);
  args.wire_row_bytes = wire_row_bytes;
  args.with_weights = with_weights;
  args.trace = trace;
  args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
  const PlanSendsShape shape = args.plan_shape();
  const int64_t T = num_tokens, k = top_k, N = size, L = num_experts / size, NC = N * capacity;
  const int64_t R = shape.rows_per_member(), S = shape.num_rows(), I = sizeof(int32_t);
  const int grid = ChooseMoeDispatchBlocks(args, blocks, SmsPerRank(size));
  Resources resources;
  Ranks ranks(resources, size, MoeDispatchSlotBytes(size, R, top_k, on, wire_row_bytes, with_weights), 0);
  const int64_t clock_count = int64_t{size} * grid * kMoeDispatchPhases;
  int64_t* clocks = phases ? resources.Filled<int64_t>(clock_count * 8, 0, "phase clocks") : nullptr;
  std::vector<Operand> operands = {
      {"tokens", T * row_bytes, false},
      {"expert_ids", T * k * I, false},
      {"weights", T * k * I, false},
      {"expert_rows", NC * row_bytes, true},
      {"group_sizes", L * I, true},
      {"order", T * k * I, true},
      {"send_counts", N * L * I, true},
      {"recv_counts", N * L * I, true},
      {"to_expert_major", NC * I, true},
      {"to_source_major", NC * I, true},
      {"return_slot", T * k * I, true},
      {"dropped", N * I, true},
      {"send_token", S * I, true},
      {"token_counts", N * I, true},
      {"return_row", T * N * I, true},
      {"recv_tokens", N * I, true},
      {"expand_rows", NC * I, true},
      {"pair_entry", NC * I, true},
      {"row_pairs", N * R * k * I, true},
      {"send_back_rows", N * R * I, true},
      {"recv_weights", N * R * (with_weights ? k : 0) * I, true},
  };
  Outcome outcome = Run(resources, ranks, operands, {&tokens, &expert_ids, &weights}, schedule,
                        [&](int rank, int slot, cudaStream_t stream) {
                          MoeDispatchArgs mine = args;
                          auto at = [&](int i) { return operands[i].At(slot, rank, size); };
                          auto ints = [&](int i) { return reinterpret_cast<int32_t*>(at(i)); };
                          mine.rank = rank;
                          mine.site = rank;
                          mine.tokens_in = at(0);
                          mine.expert_ids = ints(1);
                          mine.weights = with_weights ? reinterpret_cast<const float*>(at(2)) : nullptr;
                          mine.expert_rows = at(3);
                          mine.placed.group_sizes = ints(4);
                          mine.plan.order = ints(5);
                          mine.plan.send_counts = ints(6);
                          mine.placed.recv_counts = ints(7);
                          mine.placed.to_expert_major = ints(8);
                          mine.placed.to_source_major = ints(9);
                          mine.plan.return_slot = ints(10);
                          mine.plan.dropped = ints(11);
                          mine.plan.send_token = ints(12);
                          mine.plan.token_counts = ints(13);
                          mine.plan.return_row = ints(14);
                          mine.recv_tokens = ints(15);
                          mine.placed.expand_rows = ints(16);
                          mine.placed.pair_entry = ints(17);
                          mine.placed.row_pairs = ints(18);
                          mine.placed.send_back_rows = ints(19);
                          mine.placed.recv_weights = reinterpret_cast<float*>(at(20));
                          mine.table = ranks.table[rank];
                          mine.control = ranks.control[rank];
                          if (clocks != nullptr) mine.phase_clocks = clocks + int64_t{rank} * grid * kMoeDispatchPhases;
                          return LaunchMoeDispatch(mine, grid, stream);
                        });
  nb::dict result = ToDict(std::move(outcome),
                           std::vector<std::string>(std::begin(kMoeDispatchResults), std::end(kMoeDispatchResults)),
                           grid);
  result["lines"] = MoeDispatchUsesLines(args);
  if (clocks != nullptr) AddPhaseClocks(result, clocks, clock_count, kMoeDispatchPhaseNames);
  return result;
}

// The masked dispatch's results, in the order MoeMaskedDispatch returns them (the FFI handler's).
constexpr const char* kMoeMaskedDispatchResults[] = {"expert_rows",    "group_sizes", "send_pairs",  "pair_slot",
                                                     "send_counts",    "dropped",     "recv_counts", "row_pair",
                                                     "recv_weights",   "recv_tokens", "choice_rows", "choice_weights",
                                                     "send_back_rows", "return_row"};

nb::dict MoeMaskedDispatch(const nb::bytes& tokens, const nb::bytes& expert_ids, const nb::bytes& weights, int size,
                           int calls, int64_t num_tokens, int64_t hidden, int type, int top_k, int64_t num_experts,
                           int64_t capacity, int wire, bool with_weights, int blocks, bool trace, bool phases,
                           bool graph, int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  Require(type >= 0 && type <= 2, "type is " + std::to_string(type) + ", expected 0 (f32), 1 (bf16) or 2 (f16)");
  Require(wire >= 0 && wire <= 2, "wire is " + std::to_string(wire) + ", expected 0 (none), 1 (e4m3) or 2 (e5m2)");
  const int64_t element_bytes = FloatTypeBytes(static_cast<FloatType>(type));
  const MoeWire on = static_cast<MoeWire>(wire);
  const int64_t row_bytes = hidden * element_bytes, wire_row_bytes = MoeDispatchWireRowBytes(hidden, element_bytes, on);
  Require(num_tokens >= 0 && top_k >= 1 && top_k <= kMaxMoeMaskedTopK && num_tokens * top_k <= kMaxMoeMaskedPairs &&
              hidden >= 0 && row_bytes % 16 == 0 &&
              (on == MoeWire::kNone || (hidden % kMoeWireBlock == 0 && wire_row_bytes % 16 == 0)),
          "bad sizes: tokens and top_k within the kernel's limits, rows a multiple of 16 bytes (an 8-bit wire: "
          "hidden a multiple of the wire block)");
  Require(num_experts >= 1 && num_experts % size == 0 && num_experts <= kMaxRoutingExperts && capacity >= 1 &&
              capacity <= kMaxCapacity / num_experts,
          "bad sizes: num_experts a multiple of size up to the routing's limit, capacity positive, num_experts * "
          "capacity within int32");
  MoeMaskedDispatchArgs args;
  args.size = size;
  args.top_k = top_k;
  args.tokens = num_tokens;
  args.num_experts = num_experts;
  args.capacity = capacity;
  args.row_bytes = row_bytes;
  args.wire = on;
  args.token_type = static_cast<FloatType>(type);
  args.wire_row_bytes = wire_row_bytes;
  args.with_weights = with_weights;
  args.trace = trace;
  args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
  const int64_t T = num_tokens, k = top_k, N = size, L = num_experts / size, NC = N * capacity, P = T * k;
  const int64_t I = sizeof(int32_t), R = std::min(T, L * capacity);
  const int grid = ChooseMoeMaskedDispatchBlocks(args, blocks, SmsPerRank(size));
  Resources resources;
  Ranks ranks(resources, size, MoeMaskedDispatchSlotBytes(size, T, L, capacity, on, wire_row_bytes), 0);
  const int64_t clock_count = int64_t{size} * grid * kMoeMaskedDispatchPhases;
  int64_t* clocks = phases ? resources.Filled<int64_t>(clock_count * 8, 0, "phase clocks") : nullptr;
  std::vector<Operand> operands = {
      {"tokens", T * row_bytes, false},
      {"expert_ids", P * I, false},
      {"weights", P * I, false},
      {"expert_rows", L * NC * row_bytes, true},
      {"group_sizes", L * I, true},
      {"send_pairs", P * I, true},
      {"pair_slot", P * I, true},
      {"send_counts", N * L * I, true},
      {"dropped", N * I, true},
      {"recv_counts", N * L * I, true},
      {"row_pair", L * NC * I, true},
      {"recv_weights", L * (with_weights ? NC : 0) * I, true},
      {"recv_tokens", N * I, true},
      {"choice_rows", N * R * k * I, true},
      {"choice_weights", N * R * (with_weights ? k : 0) * I, true},
      {"send_back_rows", N * R * I, true},
      {"return_row", T * N * I, true},
  };
  Outcome outcome = Run(resources, ranks, operands, {&tokens, &expert_ids, &weights}, schedule,
                        [&](int rank, int slot, cudaStream_t stream) {
                          MoeMaskedDispatchArgs mine = args;
                          auto at = [&](int i) { return operands[i].At(slot, rank, size); };
                          auto ints = [&](int i) { return reinterpret_cast<int32_t*>(at(i)); };
                          mine.rank = rank;
                          mine.site = rank;
                          mine.tokens_in = at(0);
                          mine.expert_ids = ints(1);
                          mine.weights = with_weights ? reinterpret_cast<const float*>(at(2)) : nullptr;
                          mine.expert_rows = at(3);
                          mine.group_sizes = ints(4);
                          mine.send_pairs = ints(5);
                          mine.pair_slot = ints(6);
                          mine.send_counts = ints(7);
                          mine.dropped = ints(8);
                          mine.recv_counts = ints(9);
                          mine.row_pair = ints(10);
                          mine.recv_weights = reinterpret_cast<float*>(at(11));
                          mine.recv_tokens = ints(12);
                          mine.choice_rows = ints(13);
                          mine.choice_weights = reinterpret_cast<float*>(at(14));
                          mine.send_back_rows = ints(15);
                          mine.return_row = ints(16);
                          mine.table = ranks.table[rank];
                          mine.control = ranks.control[rank];
                          if (clocks != nullptr) {
                            mine.phase_clocks = clocks + int64_t{rank} * grid * kMoeMaskedDispatchPhases;
                          }
                          return LaunchMoeMaskedDispatch(mine, grid, stream);
                        });
  nb::dict result = ToDict(std::move(outcome),
                           std::vector<std::string>(std::begin(kMoeMaskedDispatchResults),
                                                    std::end(kMoeMaskedDispatchResults)),
                           grid);
  result["lines"] = MoeMaskedDispatchUsesLines(args);
  if (clocks != nullptr) AddPhaseClocks(result, clocks, clock_count, kMoeMaskedDispatchPhaseNames);
  return result;
}

nb::dict MoeMaskedCombine(const nb::bytes& expert_out, const nb::bytes& row_pair, const nb::bytes& pair_slot,
                          const nb::bytes& weights, int size, int calls, int type, int64_t local_experts,
                          int64_t capacity, int64_t tokens, int top_k, int64_t hidden, int blocks, bool trace,
                          bool phases, bool graph, int64_t timeout_ms, int absent, int late, int64_t late_us) {
  const Schedule schedule{calls, graph, absent, late, late_us, timeout_ms};
  CheckSchedule(size, schedule);
  Require(type >= 0 && type <= 2, "type is " + std::to_string(type) + ", expected 0 (f32), 1 (bf16) or 2 (f16)");
  const int element_bytes = FloatTypeBytes(static_cast<FloatType>(type));
  Require(tokens >= 1 && top_k >= 1 && top_k <= kMaxMoeMaskedTopK && tokens * top_k <= kMaxMoeMaskedPairs &&
              local_experts >= 1 && capacity >= 1 && capacity <= kMaxCapacity / (local_experts * size) && hidden >= 1 &&
              hidden * element_bytes % 16 == 0,
          "bad sizes: tokens, top_k, local_experts, capacity and hidden positive within the kernel's limits, rows a "
          "multiple of 16 bytes");
  MoeMaskedCombineArgs args;
  args.type = static_cast<FloatType>(type);
  args.size = size;
  args.top_k = top_k;
  args.local_experts = local_experts;
  args.expert_rows = size * capacity;
  args.tokens = tokens;
  args.hidden = hidden;
  args.trace = trace;
  args.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000;
  const int grid = ChooseMoeMaskedCombineBlocks(args, blocks, SmsPerRank(size));
  Resources resources;
  const int64_t P = tokens * top_k, rows = local_experts * size * capacity, I = sizeof(int32_t);
  Ranks ranks(resources, size, MoeMaskedCombineSlotBytes(P, hidden, element_bytes), 0);
  const int64_t clock_count = int64_t{size} * grid * kMoeMaskedCombinePhases;
  int64_t* clocks = phases ? resources.Filled<int64_t>(clock_count * 8, 0, "phase clocks") : nullptr;
  std::vector<Operand> operands = {
      {"expert_out", rows * hidden * element_bytes, false},
      {"row_pair", rows * I, false},
      {"pair_slot", P * I, false},
      {"weights", P * I, false},
      {"out", tokens * hidden * element_bytes, true},
  };
  Outcome outcome = Run(resources, ranks, operands, {&expert_out, &row_pair, &pair_slot, &weights}, schedule,
                        [&](int rank, int slot, cudaStream_t stream) {
                          MoeMaskedCombineArgs mine = args;
                          mine.rank = rank;
                          mine.site = rank;
                          mine.expert_out = operands[0].At(slot, rank, size);
                          mine.row_pair = reinterpret_cast<const int32_t*>(operands[1].At(slot, rank, size));
                          mine.pair_slot = reinterpret_cast<const int32_t*>(operands[2].At(slot, rank, size));
                          mine.weights = reinterpret_cast<const float*>(operands[3].At(slot, rank, size));
                          mine.out = operands[4].At(slot, rank, size);
                          mine.table = ranks.table[rank];
                          mine.control = ranks.control[rank];
                          if (clocks != nullptr) {
                            mine.phase_clocks = clocks + int64_t{rank} * grid * kMoeMaskedCombinePhases;
                          }
                          return LaunchMoeMaskedCombine(mine, grid, stream);
                        });
  nb::dict result = ToDict(std::move(outcome), {"out"}, grid);
  if (clocks != nullptr) AddPhaseClocks(result, clocks, clock_count, kMoeMaskedCombinePhaseNames);
  return result;
}

}  // namespace
}  // namespace jax_ncclx

NB_MODULE(_ncclx_loopback, m) {
  namespace jn = jax_ncclx;
  m.doc() = "Test-only: jax_ncclx's NVLink kernels with several ranks on one GPU (see nvlink_loopback.cc).";
  m.def("collective", &jn::Collective, nb::arg("op"), nb::arg("x"), nb::kw_only(), nb::arg("size"), nb::arg("calls"),
        nb::arg("bytes"), nb::arg("element_bytes"), nb::arg("algorithm") = 1, nb::arg("protocol") = 0,
        nb::arg("reduce_op") = 0, nb::arg("reduce_type") = 0, nb::arg("direct") = false, nb::arg("blocks") = 0,
        nb::arg("trace") = false, nb::arg("graph") = false, nb::arg("timeout_ms") = 5000, nb::arg("absent") = -1,
        nb::arg("late") = -1, nb::arg("late_us") = 0,
        "Runs `calls` calls of one NVLink collective ('all_reduce', 'all_gather', 'all_to_all') on `size`\n"
        "logical ranks of the current GPU. x: bytes of [calls, size, bytes]; attributes as the FFI handler's.\n"
        "absent: a rank that never launches (its peers must give up and name it); late: a rank whose stream\n"
        "sleeps late_us on the host before each of its calls. Returns {'y': bytes of\n"
        "[calls, size, output bytes], 'ranks': per rank {calls_finished, fault, fault_call, aborted_by,\n"
        "missing, trace (the device timeline of traced calls)}, 'blocks': the grid}.");
  m.def("all_to_allv", &jn::AllToAllv, nb::arg("x"), nb::arg("counts"), nb::arg("send_rows").none(),
        nb::arg("suffix").none(), nb::arg("place").none(), nb::kw_only(), nb::arg("size"), nb::arg("calls"),
        nb::arg("batch"), nb::arg("source_rows"), nb::arg("num_rows"), nb::arg("num_chunks"), nb::arg("capacity"),
        nb::arg("row_bytes"), nb::arg("suffix_bytes"), nb::arg("out_rows"), nb::arg("packed"), nb::arg("direct"),
        nb::arg("blocks") = 0, nb::arg("trace") = false, nb::arg("graph") = false, nb::arg("timeout_ms") = 5000,
        nb::arg("absent") = -1, nb::arg("late") = -1, nb::arg("late_us") = 0,
        "Runs `calls` calls of the NVLink all_to_allv_dynamic kernel on `size` logical ranks of the current\n"
        "GPU. Each input is bytes of [calls, size, ...]: x [B, X, row_bytes - suffix_bytes], counts int32\n"
        "[B, size, K], send_rows int32 [B, S] or None, suffix [B, S, suffix_bytes] or None, place int32\n"
        "[B, size * capacity] or None (ragged_all_to_all: y is then [B, out_rows, row_bytes], its rows starting as\n"
        "0xA5 bytes). Returns y, recv_counts and dropped (bytes of [calls, size, ...]), 'ranks' and 'blocks' as\n"
        "collective() does.");
  m.def("moe_combine", &jn::MoeCombine, nb::arg("expert_out"), nb::arg("row_pairs"), nb::arg("weights"),
        nb::arg("recv_tokens"), nb::arg("return_row"), nb::kw_only(), nb::arg("size"), nb::arg("calls"),
        nb::arg("type"), nb::arg("expert_rows"), nb::arg("rows_per_member"), nb::arg("top_k"), nb::arg("tokens"),
        nb::arg("hidden"), nb::arg("blocks") = 0, nb::arg("trace") = false, nb::arg("graph") = false,
        nb::arg("timeout_ms") = 5000, nb::arg("absent") = -1, nb::arg("late") = -1, nb::arg("late_us") = 0,
        "Runs `calls` calls of moe.combine's NVLink kernel on `size` logical ranks of the current GPU. Each\n"
        "input is bytes of [calls, size, ...]: expert_out [expert_rows, hidden] of `type` (0 f32, 1 bf16, 2 f16),\n"
        "row_pairs int32 [size * rows_per_member, top_k], weights float32 of the same shape, recv_tokens int32\n"
        "[size], return_row int32 [tokens, size]. Returns out (bytes of [calls, size, tokens, hidden]), 'ranks'\n"
        "and 'blocks' as collective() does.");
  m.def("moe_dispatch", &jn::MoeDispatch, nb::arg("tokens"), nb::arg("expert_ids"), nb::arg("weights"), nb::kw_only(),
        nb::arg("size"), nb::arg("calls"), nb::arg("num_tokens"), nb::arg("row_bytes"), nb::arg("top_k"),
        nb::arg("num_experts"), nb::arg("capacity"), nb::arg("with_weights"), nb::arg("wire") = 0, nb::arg("type") = 0,
        nb::arg("blocks") = 0, nb::arg("trace") = false, nb::arg("phases") = false, nb::arg("graph") = false,
        nb::arg("timeout_ms") = 5000, nb::arg("absent") = -1, nb::arg("late") = -1, nb::arg("late_us") = 0,
        "Runs `calls` calls of moe.dispatch's NVLink kernel on `size` logical ranks of the current GPU. Each\n"
        "input is bytes of [calls, size, ...]: tokens [num_tokens, row_bytes], expert_ids int32 [num_tokens,\n"
        "top_k], weights float32 of the same shape (read with with_weights only). wire: 0 none (rows of any\n"
        "dtype), 1 float8_e4m3fn, 2 float8_e5m2 (tokens of `type`: 0 f32, 1 bf16, 2 f16). Returns every result of the\n"
        "kernel by name (bytes of [calls, size, ...], shapes as the FFI handler's), 'ranks' and 'blocks' as\n"
        "collective() does. phases: also 'phase_clocks' (int64 bytes of [size, blocks, len(phase_names)], the\n"
        "last call's clock64() per block at each of 'phase_names', moe_dispatch.h) and 'clock_khz'.");
  m.def("moe_masked_dispatch", &jn::MoeMaskedDispatch, nb::arg("tokens"), nb::arg("expert_ids"), nb::arg("weights"),
        nb::kw_only(), nb::arg("size"), nb::arg("calls"), nb::arg("num_tokens"), nb::arg("hidden"), nb::arg("type"),
        nb::arg("top_k"), nb::arg("num_experts"), nb::arg("capacity"), nb::arg("wire") = 0,
        nb::arg("with_weights") = false, nb::arg("blocks") = 0, nb::arg("trace") = false, nb::arg("phases") = false,
        nb::arg("graph") = false, nb::arg("timeout_ms") = 5000, nb::arg("absent") = -1, nb::arg("late") = -1,
        nb::arg("late_us") = 0,
        "Runs `calls` calls of the masked dispatch's NVLink kernel on `size` logical ranks of the current GPU.\n"
        "Each input is bytes of [calls, size, ...]: tokens [num_tokens, hidden] of `type` (0 f32, 1 bf16, 2 f16),\n"
        "expert_ids int32 [num_tokens, top_k], weights float32 of the same shape (read with with_weights only).\n"
        "wire: 0 none, 1 float8_e4m3fn, 2 float8_e5m2. Returns every result of the kernel by name (bytes of\n"
        "[calls, size, ...], shapes as the FFI handler's: expert_rows, group_sizes, send_pairs, pair_slot,\n"
        "send_counts, dropped, recv_counts, row_pair, recv_weights, recv_tokens, choice_rows, choice_weights,\n"
        "send_back_rows, return_row), 'ranks' and 'blocks' as collective() does.\n"
        "phases: also 'phase_clocks', 'phase_names' (moe_masked.h) and 'clock_khz', as moe_dispatch's.");
  m.def("moe_masked_combine", &jn::MoeMaskedCombine, nb::arg("expert_out"), nb::arg("row_pair"), nb::arg("pair_slot"),
        nb::arg("weights"), nb::kw_only(), nb::arg("size"), nb::arg("calls"), nb::arg("type"), nb::arg("local_experts"),
        nb::arg("capacity"), nb::arg("tokens"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("blocks") = 0,
        nb::arg("trace") = false, nb::arg("phases") = false, nb::arg("graph") = false, nb::arg("timeout_ms") = 5000,
        nb::arg("absent") = -1, nb::arg("late") = -1, nb::arg("late_us") = 0,
        "Runs `calls` calls of the masked combine's NVLink kernel on `size` logical ranks of the current GPU.\n"
        "Each input is bytes of [calls, size, ...]: expert_out [local_experts, size * capacity, hidden] of `type`\n"
        "(0 f32, 1 bf16, 2 f16), row_pair int32 [local_experts, size * capacity], pair_slot int32\n"
        "[tokens * top_k], weights float32 [tokens, top_k] (given to combine). Returns out (bytes of [calls,\n"
        "size, tokens, hidden]), 'ranks' and 'blocks' as collective() does; phases: the phase clocks as\n"
        "moe_masked_dispatch's.");
}
