// The routing of jax_ncclx.moe.dispatch, the arithmetic around its exchange, as two ops with a CPU handler
// (moe_routing_cpu.cc, one element at a time) and a CUDA handler (moe_routing_cuda.cc, one kernel launch):
//   plan_sends       sender side: from the expert ids, what goes to which member, in which row, with which
//                    tags, and where each pair's output comes back in combine;
//   place_received   receiver side: from the received tags, where each pair's row goes in the expert-major
//                    layout, and the gather indices that combine and the backward passes reuse (per pair, and
//                    per received row for the exchanges that send one row per token back).
// The results are specified in jax_ncclx/_src/ops/moe_routing.py (and by the NumPy reference in tests/).
// This header is plain C++: the CPU module, the CUDA handlers and the device code all include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/contract.h"
#include "common/host_device.h"

namespace jax_ncclx {

// Words of int32 that each of dispatch's send rows carries after its token (its suffix): the k tags, padded
// with -1 to a multiple of 4 words (16 bytes, so that rows of 16-byte multiples stay so), then, when dispatch
// has router weights, the k weights of the row's token as float32 bits, padded with zeros the same way.
NCCLX_HOST_DEVICE inline int64_t PaddedWords(int64_t top_k) { return (top_k + 3) / 4 * 4; }
NCCLX_HOST_DEVICE inline int64_t SuffixWords(int64_t top_k, bool with_weights) {
  return PaddedWords(top_k) * (with_weights ? 2 : 1);
}

// Word `i` of a suffix at `p`, which need not be 4-byte aligned (rows of odd widths).
NCCLX_HOST_DEVICE inline int32_t SuffixWord(const uint8_t* p, int64_t i) {
  int32_t word;
  memcpy(&word, p + 4 * i, sizeof(word));
  return word;
}

struct PlanSendsShape {
  int64_t batch = 0;          // B
  int64_t num_tokens = 0;     // T
  int64_t top_k = 0;          // k
  int64_t num_experts = 0;    // E
  int64_t num_members = 0;    // N, a divisor of E
  int64_t capacity = 0;       // C: pairs any member takes from this one
  bool with_weights = false;  // the send rows' suffixes carry the tokens' router weights
  NCCLX_HOST_DEVICE int64_t local_experts() const { return num_experts / num_members; }
  NCCLX_HOST_DEVICE int64_t num_pairs() const { return num_tokens * top_k; }
  // S: a member takes at most C pairs and at most one row per token, and a token goes to at most
  // min(k, N) members.
  NCCLX_HOST_DEVICE int64_t num_rows() const {
    const int64_t per_token = top_k < num_members ? top_k : num_members;
    return num_tokens * per_token < num_members * capacity ? num_tokens * per_token : num_members * capacity;
  }
  // R: the most rows a member gets from this one (one per token, at most C), hence the rows per member of the
  // exchanges that send them back.
  NCCLX_HOST_DEVICE int64_t rows_per_member() const { return capacity < num_tokens ? capacity : num_tokens; }
  NCCLX_HOST_DEVICE int64_t suffix_words() const { return SuffixWords(top_k, with_weights); }
};

// The results of plan_sends, int32, each with a leading batch dimension B.
struct PlanSendsResults {
  int32_t* order = nullptr;         // [T * k] the pairs sorted (stably) by expert, no-expert pairs last
  int32_t* send_counts = nullptr;   // [N, E / N] pairs for each expert
  int32_t* send_token = nullptr;    // [S] the token of each send row; T past the data
  int32_t* send_suffix = nullptr;   // [S, SuffixWords] each row's suffix: its tags, the pairs it carries as
                                    // (row * k + choice) * E_local + local expert (or -1), and its weights
  int32_t* token_counts = nullptr;  // [N] send rows for each member
  int32_t* return_slot = nullptr;   // [T * k] where each pair's output returns in combine; N * C if nowhere
  int32_t* return_row = nullptr;    // [T, N] where token t's row returns from member m when rows come back one
                                    // per token: m * R + its row among m's; N * R if it was not sent there
  int32_t* dropped = nullptr;       // [N] pairs for each member past the capacity
};

struct PlaceReceivedShape {
  int64_t batch = 0;            // B
  int64_t num_members = 0;      // N
  int64_t rows_per_source = 0;  // R: the exchange's padded rows per source
  int64_t top_k = 0;            // k
  int64_t local_experts = 0;    // E_local
  int64_t capacity = 0;         // C: the expert-major layout has N * C rows
  int64_t row_bytes = 0;        // bytes of a received row
  int64_t suffix_offset = 0;    // where its suffix starts (bytes; the suffix fits in the row)
  bool with_weights = false;    // the suffixes carry router weights
};

// The results of place_received, int32, each with a leading batch dimension B.
struct PlaceReceivedResults {
  int32_t* recv_counts = nullptr;      // [N, E_local] pairs from each source for each local expert
  int32_t* group_sizes = nullptr;      // [E_local] pairs for each local expert
  int32_t* expand_rows = nullptr;      // [N * C] the received row of each expert-major row; N * R if none
  int32_t* to_expert_major = nullptr;  // [N * C] the same with one row per pair, C per source; N * C if none
  int32_t* to_source_major = nullptr;  // [N * C] the expert-major row of each row sent back; N * C if none
  int32_t* pair_entry = nullptr;  // [N * C] received row * k + choice of each expert-major row; N * R * k if none
  int32_t* row_pairs = nullptr;  // [N * R, k] the expert-major row of each received row's choice; N * C if none
  int32_t* send_back_rows = nullptr;  // [N * R] the received rows of every source, packed from row 0; N * R after
  float* recv_weights = nullptr;  // [N * R, k] the router weights in the suffixes (with_weights), else [N * R, 0]
};

// A pair's sort key: its expert, or E for an id outside [0, E) (no expert: sorts last, counted nowhere).
NCCLX_HOST_DEVICE inline int32_t RoutingKey(int32_t expert_id, int32_t num_experts) {
  return expert_id >= 0 && expert_id < num_experts ? expert_id : num_experts;
}

}  // namespace jax_ncclx
