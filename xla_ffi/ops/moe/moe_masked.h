// moe.dispatch's masked layout (jax_ncclx/_src/ops/moe_masked.py) in one NVLink kernel, and moe.combine's with
// the weights given to combine in another, for decode sizes (with the weights given to dispatch, combine is
// moe_combine.h's kernel over the token rows this dispatch describes). Shapes: N members, E experts, L = E / N
// local experts, T tokens, k choices, P = T * k pairs (pair p = t * k + c), C the capacity of one (local
// expert, source member), R = min(T, L * C) token rows with a kept pair one source delivers to one member.
//
// Dispatch. The sender decides every slot alone: pair p with id in [0, E) goes to member m = id / L, local expert
// e = id % L, as its j-th pair to that expert (j: earlier pairs of this member with the same id), and is kept
// if j < C. Every block counts the ids itself, in shared memory (the same counts in each: no grid barrier
// before the rows go out), with one warp (up to half of them for large calls) while its other warps send its
// share of the rows: token t's row once to each member that one of its ids names, as row me * T + t of that
// member's slots (so a token with several choices on one member crosses the link once). The rows go out before
// the count says which pairs are kept: a row whose pairs on that member are all dropped travels but is never
// read. Once counted, it takes the rank r of each token among those this member sends each member with a kept
// pair (the token rows' order, which combine's way back keeps) and writes its share of the kept pairs'
// {p | r << 16, weight} into entry (me, e, j) of m's pair map; block 0 writes this member's kept pairs per
// (member, expert) and token rows per member into each member's counts. Each block fills its share of the
// token rows' "none" entries, raises arrived[me][b] on every member and writes its share of the token side's
// results (off the critical path). Once every (source, block) flag holds the call's epoch, every block reads
// the counts, lays out expert e's rows source by source (source s's from off(e, s), the sum of the earlier
// sources' counts) and writes its share of the [L, N * C] rows: a warp per (row, piece) reads map entry
// (s, e, j) of row off(e, s) + j below group_sizes[e], then copies slot row s * T + t of its pair p, t = p / k;
// the row's first piece also writes the row's indices and its entry in choice_rows; zeros past group_sizes[e].
//
// Dispatch slots: in every rank's low-latency half of the call's parity (symmetric_layout.h), past the LL
// areas: the counts, [N][L] int32 (source s's from s * L) then [N] token rows per source, then the pair map,
// [N][L][C] int2 {p | r << 16, weight bits}, each rounded up to 256 bytes, then [N, T] slot rows of
// wire_row_bytes. Calls up to kMoeLinesMaxBytes of slot rows take lines instead: each
// count and map entry is a 16-byte entry with a flag in each 8-byte half (EntryOf), each slot row LL128 lines
// in whole warp steps (ll128_lines.cuh), all carrying the call's flag. No block raises a flag for peers; the
// receive side polls each member's counts, then each map entry and row line it reads, and every block of its
// own rank raises arrived[me][b] at its start once its share of choice_rows' "none" entries is written, which
// every block awaits before it writes a real entry. On an 8-bit wire the sender quantizes
// each block of kMoeWireBlock values as it writes it and the expansion dequantizes as it copies, with
// moe.dispatch's arithmetic (wire_rows.cuh); as lines, three blocks and their scales a warp step
// (wire_lines.cuh).
//
// Combine (weights given to combine). The expert side sends each row (e, i) whose row_pair is s * P + p < N * P
// back to source s, as row p of its slots, and raises arrived[me][b] on every member; the token side waits for
// every (member, block) flag, then adds each token's kept pairs' rows times their weights in float32, in choice
// order, and rounds once. Combine slots: P rows of H' elements, past the LL areas of the largest communicator
// (MoeMaskedCombineSlotBytes takes no size).
//
// As for moe.dispatch's and moe.combine's kernels, writers never wait for readers: a rank cannot still be
// reading a half that a peer writes two calls later (symmetric_layout.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/contract.h"
#include "common/symmetric_layout.h"

namespace jax_ncclx {

// Where a profiled call (phase_clocks, test-only) has thread 0 of each block read clock64(): at its start, then
// at the end of each phase, after a block barrier that only profiled calls take.
enum MoeMaskedDispatchPhase : int {
  kMaskedDispatchStart,    // the block begins
  kMaskedDispatchCounted,  // every pair's rank and the pairs per id, in shared memory; the block's share of
                           // the rows sent (their stores may still drain)
  kMaskedDispatchSent,     // the token rows' ranks, the header and map, its flags
  kMaskedDispatchResults,  // the token side's results (the block's share)
  kMaskedDispatchArrived,  // every (member, block) flag seen
  kMaskedDispatchIndexed,  // the header read: recv_counts, group_sizes, recv_tokens and send_back_rows written
  kMaskedDispatchEnd,      // the expert rows and their indices (row_pair, recv_weights, choice_rows) written
  kMoeMaskedDispatchPhases
};
inline constexpr const char* kMoeMaskedDispatchPhaseNames[kMoeMaskedDispatchPhases] = {"start",   "counted", "sent",
                                                                                       "results", "arrived", "indexed",
                                                                                       "end"};

enum MoeMaskedCombinePhase : int {
  kMaskedCombineStart,    // the block begins
  kMaskedCombineSent,     // the expert side's rows (the block's share) and its flags
  kMaskedCombineArrived,  // every (member, block) flag seen
  kMaskedCombineEnd,      // the tokens' sums written
  kMoeMaskedCombinePhases
};
inline constexpr const char* kMoeMaskedCombinePhaseNames[kMoeMaskedCombinePhases] = {"start", "sent", "arrived", "end"};

struct MoeMaskedDispatchArgs {
  int rank = 0;
  int size = 1;                // N
  int top_k = 1;               // k
  int64_t tokens = 0;          // T
  int64_t num_experts = 0;     // E, a multiple of N; E * C at most kMaxCapacity
  int64_t capacity = 0;        // C: kept pairs per (local expert, source member)
  int64_t row_bytes = 0;       // a token row's bytes (H elements), a multiple of 16
  MoeWire wire = MoeWire::kNone;           // how rows travel (contract.h)
  FloatType token_type = FloatType::kF32;  // tokens' dtype, which an 8-bit wire converts from and to
  int64_t wire_row_bytes = 0;  // a row's bytes in the slots (MoeDispatchWireRowBytes), a multiple of 16
  bool with_weights = false;   // the rows carry their pair's router weight
  bool trace = false;
  int64_t site = 0;
  uint64_t timeout_ns = 0;
  const void* tokens_in = nullptr;      // [T, H]
  const int32_t* expert_ids = nullptr;  // [T, k]
  const float* weights = nullptr;       // [T, k] float32, or null without weights
  void* expert_rows = nullptr;          // [L, N * C, H] tokens' dtype, zero past group_sizes
  int32_t* group_sizes = nullptr;       // [L]
  int32_t* send_pairs = nullptr;        // [P] the kept pairs by pair_slot, then P
  int32_t* pair_slot = nullptr;         // [P] (m * L + e) * C + j of a kept pair, N * L * C for the others
  int32_t* send_counts = nullptr;       // [N, L] kept pairs per (member, local expert)
  int32_t* dropped = nullptr;           // [N] pairs past the capacity per member
  int32_t* recv_counts = nullptr;       // [N, L] pairs each source delivered to each local expert
  int32_t* row_pair = nullptr;          // [L, N * C] s * P + p of each row's source and pair, N * P past the data
  float* recv_weights = nullptr;        // [L, N * C] with weights (0 past the data), else unused
  int32_t* recv_tokens = nullptr;       // [N] token rows each source delivered
  int32_t* choice_rows = nullptr;       // [N * R, k] e * N * C + i of each received token row's choice, L * N * C
                                        // for a choice not kept here
  float* choice_weights = nullptr;      // [N * R, k] with weights (0 where choice_rows has none), else unused
  int32_t* send_back_rows = nullptr;    // [N * R] the received rows packed source-major, then N * R
  int32_t* return_row = nullptr;        // [T, N] m * R + r of token t's row among those sent to m, N * R for none
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
  int64_t* phase_clocks = nullptr;  // test-only: [blocks, kMoeMaskedDispatchPhases] clock64() of the call, or null
};

struct MoeMaskedCombineArgs {
  FloatType type = FloatType::kF32;  // expert_out's and the result's dtype; the kernel adds in float32
  int rank = 0;
  int size = 1;                 // N
  int top_k = 1;                // k
  int64_t local_experts = 0;    // L
  int64_t expert_rows = 0;      // N * C, rows per local expert
  int64_t tokens = 0;           // T
  int64_t hidden = 0;           // H', elements per row; H' * element bytes is a multiple of 16
  bool trace = false;
  int64_t site = 0;
  uint64_t timeout_ns = 0;
  const void* expert_out = nullptr;   // [L, N * C, H']
  const int32_t* row_pair = nullptr;  // [L, N * C] s * P + p, or N * P (no pair)
  const int32_t* pair_slot = nullptr;  // [P] below L * N * C for a kept pair
  const float* weights = nullptr;     // [T, k]
  void* out = nullptr;                // [T, H']
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
  int64_t* phase_clocks = nullptr;  // test-only: [blocks, kMoeMaskedCombinePhases] clock64() of the call, or null
};

// Where the kernels can run: every dispatch block keeps each pair's id and rank and each expert's counts in
// shared memory and each token's rank among those sent to each member
// (MoeMaskedDispatchSharedBytes, up to about 115 KiB at these limits), and a thread loads
// P / 512 ids in one batch, so at most kMaxMoeMaskedPairs pairs (T * k) and top-k at most kMaxMoeMaskedTopK
// (a combine warp holds a token's k choices on its lanes). E is at most kMaxRoutingExperts, E * C (dispatch)
// and L * N * C (combine) at most kMaxCapacity. Larger calls take the exchange chain.
constexpr int64_t kMaxMoeMaskedPairs = 2048;
constexpr int kMaxMoeMaskedTopK = 32;

// The most blocks a call takes: each raises its own arrival flag on every member.
constexpr int kMaxMoeMaskedBlocks = kMaxFlagGroups;

// Whether a dispatch call sends its N * T slot rows as LL128 lines (up to kMoeLinesMaxBytes of them), with
// flagged 16-byte entries for its counts and map: the receive side then polls what it reads instead of waiting
// for every block of every member. Larger calls send rows and flags.
bool MoeMaskedDispatchUsesLines(const MoeMaskedDispatchArgs& args);

// Bytes of each parity half a call needs (PeerTable::parity_half_bytes), a multiple of 256: dispatch's past
// the LL areas of `size` ranks; combine's past those of kMaxNvlinkRanks ranks (it takes no size). Saturated at
// the largest int64 where they would overflow.
int64_t MoeMaskedDispatchSlotBytes(int size, int64_t tokens, int64_t local_experts, int64_t capacity, MoeWire wire,
                                   int64_t wire_row_bytes);
int64_t MoeMaskedCombineSlotBytes(int64_t pairs, int64_t hidden, int element_bytes);

// Shared memory a dispatch call's blocks take, in bytes (beyond the kernel's static storage).
size_t MoeMaskedDispatchSharedBytes(const MoeMaskedDispatchArgs& args);

// Thread blocks for a call: `requested` (0 = by size), capped by kMaxMoeMaskedBlocks and the SMs (every block
// waits for every other, so all must be resident at once).
int ChooseMoeMaskedDispatchBlocks(const MoeMaskedDispatchArgs& args, int requested, int sm_count);
int ChooseMoeMaskedCombineBlocks(const MoeMaskedCombineArgs& args, int requested, int sm_count);

// Queue the call's kernel on `stream`; cudaGetLastError() of the launch (cudaErrorInvalidValue for a call
// past the limits above).
cudaError_t LaunchMoeMaskedDispatch(const MoeMaskedDispatchArgs& args, int blocks, cudaStream_t stream);
cudaError_t LaunchMoeMaskedCombine(const MoeMaskedCombineArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
