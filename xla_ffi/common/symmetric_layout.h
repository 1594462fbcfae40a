// What every rank of an NVLink communicator keeps in its "symmetric" device memory, and how the kernels
// find their peers' copies. Shared by host code (symmetric.cc) and device code (*_kernels.cu), so it holds
// plain structs only.
//
// Each rank owns two allocations that all its peers map (same process: peer access; other processes:
// CUDA IPC):
//   * a SymmetricControl block, allocated once with the communicator and never moved: the flags peers
//     write to say "I entered call e" and "my rows of group g for call e have landed", the output addresses
//     they publish for call e (one process: peers write into each other's outputs), plus local state;
//   * a data region that grows (never shrinks) to what the largest program lowered so far needs. Its size
//     comes from the ops' static shapes at lowering time. It holds, in this order:
//       - the low-latency slots: two halves of PeerTable::parity_half_bytes, one per call parity. A
//         collective writes into a peer's half of its call's parity without asking whether the peer is
//         ready: the peer cannot still be reading that half, because it finished the call two before
//         (whose half it was) before it sent its rows of the previous call, which this rank needed.
//         all_to_allv_dynamic keeps its count slots there too;
//       - the staging area of all_to_allv_dynamic (at 2 * parity_half_bytes), written only after the peer
//         entered the call (SymmetricControl::entered).
// Kernels do not take region pointers or sizes as arguments: they read them from a PeerTable in device
// memory whose address never changes, so a CUDA graph recorded before the data region grew stays valid.
#pragma once

#include <cstdint>

#include "common/contract.h"

namespace jax_ncclx {

// Arrival flags per source rank: the pieces ("groups") a kernel splits one peer's rows into, or the blocks
// of a collective times its phases.
constexpr int kMaxFlagGroups = 128;

// The most bytes of slot rows (as LL128 lines) that a call of an MoE NVLink kernel sends as lines (moe_combine.h,
// moe_dispatch.h, moe_masked.h): small calls gain from skipping the wait for every block's flag, while larger
// ones lose more to the lines' extra bytes and polls, so they send rows and flags.
constexpr int64_t kMoeLinesMaxBytes = int64_t{1} << 20;

// Calls whose device-side timeline a communicator remembers (a ring: call e lives in slot e % kTraceSlots).
constexpr int kTraceSlots = 1024;

// One call of an NVLink kernel on one rank as its GPU saw it, in %globaltimer nanoseconds. Written only by
// programs compiled with JAX_NCCLX_TRACE=1. The fields taken as a maximum over blocks need no reset between
// calls: the timer only grows, so a stale value from call e - kTraceSlots is always smaller.
struct DeviceTraceRecord {
  uint64_t epoch;     // the call; written last, so a record whose epoch matches its slot is complete
  uint64_t start_ns;  // block 0 began
  uint64_t peers_ns;  // the last block saw the peer it sends to enter the call (max over blocks)
  uint64_t sent_ns;   // the last block had sent its rows and raised their flag (max over blocks)
  uint64_t data_ns;   // the last block saw the rows it receives arrive (max over blocks)
  uint64_t end_ns;    // the last block finished
  uint32_t blocks;
  uint32_t kernel;  // which kernel (TraceKernel)
  uint64_t ready_ns;  // the last block had done its own work before its first write (moe.dispatch: the plan;
                      // set only by kernels with such work)
};

// Whether ring slot `slot` holds a complete record: one whose epoch (written last) belongs to that slot.
inline bool IsCompleteTraceRecord(const DeviceTraceRecord& record, int slot) {
  return record.epoch != 0 && record.epoch % kTraceSlots == static_cast<uint64_t>(slot);
}

// Where a rank's NVLink kernels report that they gave up waiting (device_sync.cuh, Patience). It lives in
// pinned host memory mapped into the device, so the host reads it without a CUDA call: the handlers at
// every call, the watchdog every few milliseconds.
enum NvlinkFaultState : uint32_t { kNvlinkHealthy = 0, kNvlinkGaveUp = 1, kNvlinkAborted = 2 };
struct NvlinkFault {
  uint32_t state;       // NvlinkFaultState; written last
  uint32_t kernel;      // TraceKernel of the call
  uint64_t epoch;       // the call's number among the communicator's NVLink calls
  int64_t site;         // its call site
  uint64_t waited_ns;   // kNvlinkGaveUp: how long it waited
  uint32_t aborted_by;  // kNvlinkAborted: 1 + the rank that gave up first
  uint8_t missing[kMaxNvlinkRanks];  // 1 for each rank it (kNvlinkGaveUp) or its aborter (kNvlinkAborted)
                                     // waited for in vain
};

// Rounds of one group are counted in the low bits of a progress flag, below the epoch.
constexpr int kRoundBits = 8;

// Flags hold epochs: the number of the call (1, 2, ...) on this communicator that set them. They only grow,
// so no kernel ever resets them and a recorded CUDA graph can replay forever.
struct alignas(128) SymmetricControl {
  uint64_t entered[kMaxNvlinkRanks];                  // set by rank r: r has entered call e (and finished e-1)
  uint64_t arrived[kMaxNvlinkRanks][kMaxFlagGroups];  // set by rank r: r's rows of group g for call e landed
                                                      // (bit 63: a note, device_sync.cuh kFlagNote)
  uint64_t output[kMaxNvlinkRanks];                   // set by rank r before `entered`: its output address
                                                      // for call e (same-process ranks write there directly)
  uint64_t recv_counts[kMaxNvlinkRanks];              // the same for its recv_counts output
  uint64_t place[kMaxNvlinkRanks];                    // the same for its place table (ragged_all_to_all)
  uint64_t epoch;                                     // local: calls finished on this communicator
  uint32_t abort_by;                                  // set by rank r: 1 + r gave up waiting; the
                                                      // communicator is unusable, kernels wait no more
  uint32_t blocks_started;                            // local: blocks of the current call that read its epoch
  uint32_t blocks_done;                               // local: blocks of the current traced call that finished
  uint32_t abort_missing;                             // bit p set (before abort_by) by a rank that gave up
                                                      // waiting for rank p, so aborted ranks can name p
  DeviceTraceRecord trace[kTraceSlots];               // local: timelines of the last calls (when traced)
  uint64_t progress[kMaxNvlinkRanks][kMaxFlagGroups];  // set by rank r: (e << kRoundBits) + the rounds of its
                                                       // group g for call e that landed, where a call sends
                                                       // its groups in rounds (staged all_to_allv_dynamic)
};

// One rank's view of every rank's symmetric memory (its own included), indexed by rank.
struct PeerTable {
  uint8_t* data[kMaxNvlinkRanks];
  SymmetricControl* control[kMaxNvlinkRanks];
  int64_t parity_half_bytes;  // the same on every rank; a multiple of 256
  NvlinkFault* fault;         // this rank's fault record (device address of pinned host memory)
};

}  // namespace jax_ncclx
