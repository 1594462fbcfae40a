// moe.combine in one NVLink kernel (weights given to dispatch): the expert side sums each received token
// row's weighted pairs and pushes the sum into the token side's slots, the token side adds its members'
// rows. Both halves run in one launch: no routing kernel, no exchange barrier, no gather afterwards.
//
// Slots: in every rank's low-latency half of the call's parity (symmetric_layout.h), past the LL areas, the
// token side keeps [N * R] rows of H' elements, member m's rows from row m * R (the layout of the handle's
// return_row). Member m writes row m * R + r of source s for the r-th token row s sent it. How s learns it
// landed depends on the call's size:
//   * up to kMoeLinesMaxBytes of slot rows (decode): the rows travel as LL128 lines (ll128_lines.cuh,
//     each row padded to whole warp steps of 4 lines) and s polls each line it reads. Each rank also raises
//     `entered` on every member at its start and ends the call once every member's has reached it, since a
//     token side hears only from the members its tokens chose. A return_row entry that names a row its member
//     never wrote (not one of dispatch's) waits out the timeout and aborts the communicator;
//   * larger: plain rows; m raises flag arrived[m][b] on s for each of its blocks b, and s reads once every
//     (member, block) flag holds the call's epoch.
// Writers never wait for the readers: a rank cannot still be reading a half that a peer writes two calls later
// (symmetric_layout.h), so a call costs one NVLink write and one flag latency.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/contract.h"
#include "common/symmetric_layout.h"

namespace jax_ncclx {

struct MoeCombineArgs {
  FloatType type = FloatType::kF32;  // expert_out's and the result's dtype; the kernel accumulates in float32
  int rank = 0;
  int size = 1;                 // N
  int top_k = 1;                // k
  int64_t rows_per_member = 0;  // R = min(C, T): token rows one member takes from one source
  int64_t expert_rows = 0;      // N * C, the rows of expert_out (a pair index at or past it: no pair)
  int64_t tokens = 0;           // T
  int64_t hidden = 0;           // H', elements per row; H' * element bytes is a multiple of 16
  bool trace = false;
  int64_t site = 0;
  uint64_t timeout_ns = 0;
  const void* expert_out = nullptr;      // [N * C, H'] the experts' outputs, dispatch's expert-major rows
  const int32_t* row_pairs = nullptr;    // [N * R, k] expert-major row of each received row's choice
  const float* weights = nullptr;        // [N * R, k] their router weights (0 where the choice is not here)
  const int32_t* recv_tokens = nullptr;  // [N] token rows each source delivered
  const int32_t* return_row = nullptr;   // [T, N] where token t's row from member m lands (N * R: none)
  void* out = nullptr;                   // [T, H']
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
};

// The most choices per token the kernel takes: each warp keeps its row's k indices and weights in shared
// memory (MoeCombineSharedBytes, within the default 48 KiB).
constexpr int kMaxMoeCombineTopK = 256;
size_t MoeCombineSharedBytes(int top_k);

// Whether a call sends its N * R slot rows as LL128 lines: up to kMoeLinesMaxBytes of them.
bool MoeCombineUsesLines(int size, int64_t rows_per_member, int64_t row_bytes);

// Bytes of each parity half a call needs (PeerTable::parity_half_bytes), a multiple of 256.
int64_t MoeCombineSlotBytes(int size, int64_t rows_per_member, int64_t hidden, int element_bytes);

// The most blocks a call takes: each raises its own arrival flag on every member.
constexpr int kMaxMoeCombineBlocks = kMaxFlagGroups;

// Thread blocks for a call: `requested` (0 = by size), capped by kMaxMoeCombineBlocks and the SMs.
int ChooseMoeCombineBlocks(const MoeCombineArgs& args, int requested, int sm_count);

// Queues the call's kernel on `stream`; cudaGetLastError() of the launch.
cudaError_t LaunchMoeCombine(const MoeCombineArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
