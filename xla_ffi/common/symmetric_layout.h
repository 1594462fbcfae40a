// What every rank of an NVLink communicator keeps in its "symmetric" device memory, and how the kernels
// find their peers' copies. Shared by host code (symmetric.cc) and device code (*_kernels.cu), so it holds
// plain structs only.
//
// Each rank owns two allocations that all its peers map (same process: peer access; other processes:
// CUDA IPC):
//   * a SymmetricControl block, allocated once with the communicator and never moved: the flags peers
//     write to say "I entered call e" and "my rows of group g for call e have landed", plus local state;
//   * a data region that grows (never shrinks) to what the largest program lowered so far needs; kernels
//     stage rows and counts there. Its size comes from the ops' static shapes at lowering time.
// Kernels do not take peer pointers as arguments: they read them from a PeerTable in device memory whose
// address never changes, so a CUDA graph recorded before the data region grew stays valid.
#pragma once

#include <cstdint>

namespace jax_ncclx {

// Ranks one NVLink communicator may have (one host's NVLink domain).
constexpr int kMaxNvlinkRanks = 8;
// The most pieces ("groups") a kernel splits one peer's rows into; each has its own arrival flag.
constexpr int kMaxFlagGroups = 32;

// Flags hold epochs: the number of the call (1, 2, ...) on this communicator that set them. They only grow,
// so no kernel ever resets them and a recorded CUDA graph can replay forever.
struct alignas(128) SymmetricControl {
  uint64_t entered[kMaxNvlinkRanks];                  // set by rank r: r has entered call e (and finished e-1)
  uint64_t counted[kMaxNvlinkRanks];                  // set by rank r: r's send counts for call e landed
  uint64_t arrived[kMaxNvlinkRanks][kMaxFlagGroups];  // set by rank r: r's rows of group g for call e landed
  uint64_t output[kMaxNvlinkRanks];                   // set by rank r before `entered`: its output address
                                                      // for call e (same-process ranks write there directly)
  uint64_t epoch;                                     // local: calls finished on this communicator
  uint32_t blocks_done;                               // local: blocks of the current call that finished
};

// One rank's view of every rank's symmetric memory (its own included), indexed by rank.
struct PeerTable {
  uint8_t* data[kMaxNvlinkRanks];
  SymmetricControl* control[kMaxNvlinkRanks];
};

}  // namespace jax_ncclx
