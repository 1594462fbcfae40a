// Host side of the NVLink kernels of the small-message collectives: all_reduce (one-shot and two-shot),
// all_gather and all_to_all (one-shot). They move data through the low-latency slots of the peers' symmetric
// data regions (symmetric_layout.h) and signal with per-block epoch flags, so a call costs one NVLink write
// plus one flag latency (two of each for two-shot), with no reset between calls and no host involvement.
//
//   one-shot:  every rank writes its input (all_to_all: block j of it) into slot `rank` of every peer, raises
//              its flag there, waits for all peers' flags, and builds its output from the slots it received
//              (all_reduce: reduces them in rank order, so every rank gets the same bits);
//   two-shot:  (all_reduce) reduce-scatter then all-gather through the slots: rank j reduces chunk j of all
//              inputs and writes the result into every peer; half the traffic of one-shot per rank.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/symmetric_layout.h"

namespace jax_ncclx {

enum class NvlinkCollective : int { kAllReduce = 0, kAllGather = 1, kAllToAll = 2 };
enum class NvlinkAlgorithm : int { kOneShot = 1, kTwoShot = 2 };  // two-shot: all_reduce only
enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2 };       // the reduce_op attribute's values
// Element types the all_reduce kernels reduce. 16-bit floats accumulate in f32 and round once.
enum class ReduceType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kS32 = 3 };

// The most thread blocks a call uses: one arrival flag per block and phase (kMaxFlagGroups in all).
constexpr int kMaxOneShotBlocks = kMaxFlagGroups;
constexpr int kMaxTwoShotBlocks = kMaxFlagGroups / 2;

struct NvlinkCollectiveArgs {
  NvlinkCollective op = NvlinkCollective::kAllReduce;
  NvlinkAlgorithm algorithm = NvlinkAlgorithm::kOneShot;
  ReduceOp reduce = ReduceOp::kSum;        // all_reduce only
  ReduceType reduce_type = ReduceType::kF32;  // all_reduce only
  int element_bytes = 1;
  int rank = 0;
  int size = 1;
  int64_t bytes = 0;  // of x on each rank (all_to_all: N blocks of bytes / N)
  bool trace = false;
  int64_t site = 0;         // call site, for the fault record
  uint64_t timeout_ns = 0;  // how long a wait for a peer may last (device_sync.cuh, Patience)
  const void* x = nullptr;
  void* y = nullptr;  // all_reduce: bytes; all_gather: N * bytes (block i from rank i); all_to_all: bytes
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
};

// Bytes of low-latency slots per call parity (PeerTable::parity_half_bytes) a call needs, a multiple of 256.
int64_t NvlinkCollectiveSlotBytes(NvlinkCollective op, NvlinkAlgorithm algorithm, int64_t bytes, int size,
                                  int element_bytes);

// Thread blocks for a call: `requested` (0 = by size), capped by the flags and the SMs.
int ChooseNvlinkCollectiveBlocks(const NvlinkCollectiveArgs& args, int requested, int sm_count);

// Queues the call's kernel on `stream`; cudaGetLastError() of the launch.
cudaError_t LaunchNvlinkCollective(const NvlinkCollectiveArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
