// moe.dispatch in one NVLink kernel at decode sizes: the routing (plan_sends), the exchange and the placement
// (place_received) with the expansion into expert-major rows, which the chain runs as four calls, in one
// launch. It writes every result the chain writes, with the same values (moe_routing.h specifies them).
//
// Every block first plans the sends itself, in shared memory (the same plan in each: no grid barrier before
// the rows go out), then sends its share of the rows. Slots: in every rank's low-latency half of the call's
// parity (symmetric_layout.h), past the LL areas: a 16-byte header per source (its token count), then
// [N * R] rows of row_bytes + suffix bytes, source s's rows from row s * R (the exchange's padded layout).
// Source s writes its r-th row to member m at row s * R + r of m's slots, the row's suffix right after the
// token's bytes, and raises arrived[s][b] on m for each of its blocks b. Once every (source, block) flag holds
// the call's epoch, every block reads every received tag in one round of loads, places them (again the same
// placement in each, into a map from expert-major row to received row in shared memory) and copies its share
// of the expert-major rows out of the slots. As for the combine kernel, writers never wait for readers.
// On an 8-bit wire the sender quantizes each block of kMoeWireBlock values as it writes it (a warp per block,
// or with lines per warp step of three blocks: the scale maps the block's largest magnitude to the format's
// largest finite value) and the expansion dequantizes as it copies, with the chain's arithmetic
// (moe_dispatch.py's _encode and _decode).
//
// Lines (up to kMoeLinesMaxBytes of slot rows: decode sizes). The slots hold the header,
// then [N * R * k] 16-byte list entries, then [N * R] rows of whole warp steps of LL128 lines
// (ll128_lines.cuh). Each count is a flagged entry {count, flag}; entry i of source s's list is
// {tag, weight of choice i % k of its row i / k, flag} at s * R * k + i, every one written each call (-1 past
// the list); the rows travel as lines (on the 8-bit wire three quantized blocks and their scales a warp step,
// wire_lines.cuh). No block raises a flag for its peers: each polls the counts and every list entry (the
// call's handshake, since every member writes them all), places, then polls each line it copies. The flag is
// the call's epoch scrambled (ScrambledLineFlag), so another call's bytes never match it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/contract.h"
#include "common/symmetric_layout.h"
#include "ops/moe/moe_routing.h"

namespace jax_ncclx {

// Where a profiled call (MoeDispatchArgs::phase_clocks, test-only) has thread 0 of each block read clock64():
// at its start, then after the barrier that closes each phase of the kernel.
enum MoeDispatchPhase : int {
  kPhaseStart,    // the block begins
  kPhaseCleared,  // the plan's counters are zero
  kPhaseCounted,  // pairs counted per key (within the warp-plan limits: thread 0's comparisons done)
  kPhaseSorted,   // pairs sorted by key
  kPhasePlanned,  // send rows numbered
  kPhaseSent,     // this block's rows (and with lines their list entries) stored
  kPhaseResults,  // the plan's results written (the block's share); with flags, its flags raised
  kPhaseArrived,  // every flag seen (with lines: thread 0's counts and list entries)
  kPhasePlaced,   // received tags placed (counts, the row map)
  kPhaseEnd,      // index arrays and expert rows written
  kMoeDispatchPhases
};
inline constexpr const char* kMoeDispatchPhaseNames[kMoeDispatchPhases] = {"start",   "cleared", "counted", "sorted",
                                                                           "planned", "sent",    "results", "arrived",
                                                                           "placed",  "end"};

struct MoeDispatchArgs {
  int rank = 0;
  int size = 1;               // N
  int top_k = 1;              // k
  int64_t tokens = 0;         // T
  int64_t num_experts = 0;    // E, a multiple of N
  int64_t capacity = 0;       // C
  int64_t row_bytes = 0;      // a token row's bytes (H elements), a multiple of 16
  MoeWire wire = MoeWire::kNone;         // how rows travel (contract.h)
  FloatType token_type = FloatType::kF32;  // tokens' dtype, which an 8-bit wire converts from and to
  int64_t wire_row_bytes = 0;  // a row's bytes in the slots (MoeDispatchWireRowBytes), a multiple of 16
  bool with_weights = false;  // the rows carry their token's router weights
  bool trace = false;
  int64_t site = 0;
  uint64_t timeout_ns = 0;
  const void* tokens_in = nullptr;    // [T, H]
  const int32_t* expert_ids = nullptr;  // [T, k]
  const float* weights = nullptr;     // [T, k] float32, or null without weights
  void* expert_rows = nullptr;        // [N * C, H] the received rows expert-major, zero past the data
  PlanSendsResults plan;              // the sender's results, but send_suffix (it travels in the slots only)
  int32_t* recv_tokens = nullptr;     // [N] token rows each source delivered
  PlaceReceivedResults placed;        // the receiver's results
  const PeerTable* table = nullptr;
  SymmetricControl* control = nullptr;
  int64_t* phase_clocks = nullptr;  // test-only: [blocks, kMoeDispatchPhases] clock64() of the call, or null

  NCCLX_HOST_DEVICE PlanSendsShape plan_shape() const {
    PlanSendsShape shape;
    shape.batch = 1;
    shape.num_tokens = tokens;
    shape.top_k = top_k;
    shape.num_experts = num_experts;
    shape.num_members = size;
    shape.capacity = capacity;
    shape.with_weights = with_weights;
    return shape;
  }
};

// Bytes of a token row of H elements in the slots: H * element_bytes in tokens' dtype; on an 8-bit wire H
// bytes, then a float32 scale per kMoeWireBlock values (one for the row where H is not a multiple of it): the
// chain's layout, moe_dispatch.py's _encode. The kernel takes an 8-bit wire where H is a multiple of
// kMoeWireBlock and this is a multiple of 16.
int64_t MoeDispatchWireRowBytes(int64_t hidden, int64_t element_bytes, MoeWire wire);

// Bytes of a slot row: the row's bytes on the wire, then its suffix (tags, and weights), a multiple of 16.
int64_t MoeDispatchSlotRowBytes(int top_k, int64_t wire_row_bytes, bool with_weights);

// Whether a call sends its N * R slot rows as LL128 lines (up to kMoeLinesMaxBytes of them), with its counts
// and list entries as flagged 16-byte entries: the receive side then polls what it reads instead of waiting for
// every block of every member. Larger calls send rows with suffixes and flags.
bool MoeDispatchUsesLines(const MoeDispatchArgs& args);

// Bytes of each parity half a call needs (PeerTable::parity_half_bytes), a multiple of 256: the larger of the
// two layouts where lines fit.
int64_t MoeDispatchSlotBytes(int size, int64_t rows_per_member, int top_k, MoeWire wire, int64_t wire_row_bytes,
                             bool with_weights);

// Where the kernel can run: every block keeps the plan and the placement in shared memory (up to about 216 KiB
// at these limits, so one block per SM; a thread holds up to N * T * k / 512 of the received tags in
// registers), so at most kMaxMoeDispatchPairs pairs (T * k) and kMaxMoeDispatchMemberTokens (N * T), and top-k
// at most kMaxMoeDispatchTopK. Larger calls take the chain.
constexpr int64_t kMaxMoeDispatchPairs = 2048;
constexpr int64_t kMaxMoeDispatchMemberTokens = 2048;
constexpr int kMaxMoeDispatchTopK = 32;

// The most blocks a call takes: each raises its own arrival flag on every member.
constexpr int kMaxMoeDispatchBlocks = kMaxFlagGroups;

// Thread blocks for a call: `requested` (0 = by size), capped by kMaxMoeDispatchBlocks and the SMs.
int ChooseMoeDispatchBlocks(const MoeDispatchArgs& args, int requested, int sm_count);

// Queues the call's kernel on `stream`; cudaGetLastError() of the launch.
cudaError_t LaunchMoeDispatch(const MoeDispatchArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
