// Host side of the NVLink kernels of the small-message collectives: all_reduce (one-shot and two-shot),
// all_gather, all_to_all and reduce_scatter (one-shot). They move data through the low-latency slots of the peers' symmetric
// data regions (symmetric_layout.h) and signal with per-block epoch flags, so a call costs one NVLink write
// plus one flag latency (two of each for two-shot), with no reset between calls and no host involvement.
//
//   one-shot:  every rank writes its input (all_to_all: block j of it) into slot `rank` of every peer, raises
//              its flag there, waits for all peers' flags, and builds its output from the slots it received
//              (all_reduce: reduces them in rank order, so every rank gets the same bits; reduce_scatter:
//              block j goes to peer j as in all_to_all, and rank j reduces the blocks it received likewise);
//   two-shot:  (all_reduce) reduce-scatter then all-gather: rank j reduces chunk j of all inputs (sent to it
//              through the slots) and writes the result into every peer; half the traffic of one-shot per
//              rank.
// Direct calls (every rank in this process) write into the peers' outputs where no reduction needs the data
// in slots: the two-shot all-gather (a peer's address comes with its reduce-scatter flag) and simple one-shot
// all_gather / all_to_all (a peer's address comes with its `entered` flag, which costs a wait at the start).
// Calls through slots leave the receiver a copy out of them.
//
// One-shot segments (what one rank sends one peer) travel in one of three protocols, named as NCCL's:
//   LL:      8-byte words of 4 payload bytes and a 4-byte tag: twice the bytes, the lowest latency, and it
//            relies only on 8-byte stores landing whole, which the PTX memory model guarantees.
//   LL128:   128-byte lines of 120 payload bytes and an 8-byte flag (the call's epoch), each line stored by 8
//            lanes of one warp at once: 1/16 of the bytes are flags, but a line takes about 0.5 us longer to
//            be seen whole on H200 (as NCCL's latency model has it too), so it pays from ~8 KiB segments.
//   simple:  the payload as is, then one flag per thread block after a release.
// LL and LL128 apply to segments up to 64 KiB of a multiple of 4 bytes; larger or odd ones use simple.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "common/host_device.h"
#include "common/contract.h"
#include "common/symmetric_layout.h"

namespace jax_ncclx {

enum class NvlinkCollective : int { kAllReduce = 0, kAllGather = 1, kAllToAll = 2, kReduceScatter = 3 };

// The op of that name ("all_reduce", "all_gather", "all_to_all", "reduce_scatter"), if it has an NVLink kernel.
inline std::optional<NvlinkCollective> NvlinkCollectiveNamed(std::string_view name) {
  if (name == "all_reduce") return NvlinkCollective::kAllReduce;
  if (name == "all_gather") return NvlinkCollective::kAllGather;
  if (name == "all_to_all") return NvlinkCollective::kAllToAll;
  if (name == "reduce_scatter") return NvlinkCollective::kReduceScatter;
  return std::nullopt;
}

// Whether a one-shot call sends peer j only block j of its input (all_to_all, reduce_scatter); whether it
// reduces what it receives (all_reduce, reduce_scatter) rather than moving it.
NCCLX_HOST_DEVICE inline bool SendsBlocks(NvlinkCollective op) {
  return op == NvlinkCollective::kAllToAll || op == NvlinkCollective::kReduceScatter;
}
NCCLX_HOST_DEVICE inline bool Reduces(NvlinkCollective op) {
  return op == NvlinkCollective::kAllReduce || op == NvlinkCollective::kReduceScatter;
}

// The most thread blocks a call uses, one arrival flag per block and phase (kMaxFlagGroups in all): two-shot
// has two phases; one-shot keeps the cap its block counts were measured with.
constexpr int kMaxOneShotBlocks = 64;
constexpr int kMaxTwoShotBlocks = kMaxFlagGroups / 2;
static_assert(kMaxOneShotBlocks <= kMaxFlagGroups);

struct NvlinkCollectiveArgs {
  NvlinkCollective op = NvlinkCollective::kAllReduce;
  NvlinkAlgorithm algorithm = NvlinkAlgorithm::kOneShot;
  ReduceOp reduce = ReduceOp::kSum;  // all_reduce and reduce_scatter
  ReduceType reduce_type = ReduceType::kF32;  // all_reduce and reduce_scatter
  NvlinkProtocol protocol = NvlinkProtocol::kLL128;  // one-shot only
  int element_bytes = 1;
  int rank = 0;
  int size = 1;
  int64_t bytes = 0;  // of x on each rank (all_to_all, reduce_scatter: N blocks of bytes / N)
  bool direct = false;  // write into the peers' outputs where the algorithm can (every rank in this process)
  bool trace = false;
  int64_t site = 0;  // call site, for the fault record
  uint64_t timeout_ns = 0;  // how long a wait for a peer may last (device_sync.cuh, Patience)
  const void* x = nullptr;
  void* y = nullptr;  // all_reduce, all_to_all: bytes; all_gather: N * bytes (block i from rank i);
  // reduce_scatter: bytes / N
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
};

// Bytes at the start of every parity half that the LL words and LL128 lines own (their stale words must never
// come from another kernel's data); other kernels' slots start past them.
int64_t NvlinkLowLatencyAreaBytes(int size);

// Bytes of low-latency slots per call parity (PeerTable::parity_half_bytes) a call needs, a multiple of 256.
int64_t NvlinkCollectiveSlotBytes(NvlinkCollective op, NvlinkAlgorithm algorithm, NvlinkProtocol protocol,
                                  int64_t bytes, int size, int element_bytes, bool direct);

// Thread blocks for a call: `requested` (0 = by size), capped by the flags and the SMs.
int ChooseNvlinkCollectiveBlocks(const NvlinkCollectiveArgs& args, int requested, int sm_count);

// Queues the call's kernel on `stream`; cudaGetLastError() of the launch.
cudaError_t LaunchNvlinkCollective(const NvlinkCollectiveArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
