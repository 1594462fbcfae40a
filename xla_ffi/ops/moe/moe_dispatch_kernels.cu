// The NVLink kernel of moe.dispatch (see moe_dispatch.h for the algorithm and the slots).
//
// Phases of every block: plan (shared memory, the same in every block), send (a share of the rows, then one
// flag per member), wait (every member's every block), place (shared memory again, the same in every block)
// and expand (a share of the expert-major rows). Each block writes its share of every result array; the
// plan's and placement's values are the same in every block, so the shares agree.
//
// With lines (up to kMoeLinesMaxBytes of slot rows) no block waits for the others: the counts and every list
// entry travel as flagged 16-byte entries and the rows as LL128 lines (on the 8-bit wire quantized as they are
// sent, wire_lines.cuh), so the wait is the polls of what a block reads (moe_dispatch.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/device_sync.cuh"
#include "common/ll128_lines.cuh"
#include "common/symmetric_layout.h"
#include "common/warp_copy.cuh"
#include "common/wire_lines.cuh"
#include "common/wire_rows.cuh"
#include "ops/collectives/nvlink_collectives_kernels.h"
#include "ops/moe/moe_device.cuh"
#include "ops/moe/moe_dispatch.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kHeaderBytes = 256;              // a 16-byte token count per source, ahead of the rows
// With lines: warp steps of lines loaded before any is stored (send) or polled (expand), and list entries
// loaded before any is polled again, so that their latencies overlap (a take batch of 4 spills).
constexpr int kLineBatch = 4;
constexpr int kTakeBatch = 3;
constexpr int kEntryBatch = 4;
static_assert(16 * kMaxNvlinkRanks <= kHeaderBytes);
static_assert(kMaxMoeDispatchBlocks <= kMaxFlagGroups);

using BlockScan = cub::BlockScan<int32_t, kThreads>;
// Ids a thread loads at the start, all at once.
constexpr int kIdsPerThread = static_cast<int>(kMaxMoeDispatchPairs / kThreads);
static_assert(kMaxMoeDispatchPairs % kThreads == 0);

// The call's divisors (Divisor: a multiply and a shift per index instead of a division).
struct Divisors {
  Divisor top_k, local, tokens, per_source, tags_per_row;  // k, E_local, T, R * k, k * E_local
};

struct Call {
  MoeDispatchArgs args;
  Divisors by;
  int64_t slot_base;  // where the header starts in a parity half: past the LL areas
  int64_t entries_at;  // with lines: where the list entries start, past the header
  int64_t rows_at;    // where the rows start, past the header (and the list entries)
  int64_t slot_row;   // bytes of a slot row: its wire bytes and suffix, or with lines whole warp steps of lines
};

// Calls of at most this many pairs (T * k), (member, token) entries and keys sort the pairs by comparing every
// pair with every other (kComparers threads per pair) and number the send rows in one warp: past them the
// comparisons (P * P) and the warp's serial loop (a ballot per 32 entries) would cost more than the block's
// counting sort and scan.
constexpr int32_t kWarpPlanPairs = 256;
constexpr int32_t kWarpPlanEntries = 512;
constexpr int32_t kWarpPlanKeys = 1025;
constexpr int32_t kComparers = 4;

// Pairs are sorted by per-warp counting: sort warp w takes a contiguous range of pairs and a histogram row of
// E + 1 counters; at most kSortCounters counters in all, so fewer sort warps for many experts.
constexpr int32_t kSortCounters = 8192;

__host__ __device__ inline int32_t SortWarps(int64_t num_experts) {
  const int64_t fit = kSortCounters / (num_experts + 1);
  return static_cast<int32_t>(fit < 1 ? 1 : fit > kWarps ? kWarps : fit);
}

// The plan's shared memory (ints): what the send and the tags need.
struct Plan {
  int16_t* key;  // [P] each pair's routing key (RoutingKey)
  int32_t* sorted;  // [P] the pairs sorted stably by key (the result `order`)
  int32_t* counts;  // [E + 1] pairs per key
  int32_t* key_start;  // [E + 2] where each key starts in `sorted`
  int32_t* row_of;  // [N * T] (member, token): its send row, or -1
  int32_t* first_row;  // [N + 1] each member's first send row
  int32_t* send_token;  // [S] the token of each send row
  int32_t* histogram;  // [sort warps][E + 1] per sort warp and key: its pairs, then its next place in `sorted`;
                       // within the kWarpPlan* limits [P] sort words instead (key << 16 | pair)
};

// The histogram's ints: room for the sort words too where the pairs are sorted by comparing.
__host__ __device__ inline int64_t HistogramInts(int64_t P, int64_t E) {
  const int64_t counters = SortWarps(E) * (E + 1), words = P < kWarpPlanPairs ? P : kWarpPlanPairs;
  return counters > words ? counters : words;
}

__host__ __device__ inline int64_t PlanInts(int64_t P, int64_t E, int64_t N, int64_t T) {
  return P + (E + 1) + (E + 2) + N * T + (N + 1) + N * T + HistogramInts(P, E);
}

__device__ Plan LayOutPlan(int32_t* shared, int32_t P, int32_t E, int32_t N, int32_t T) {
  Plan plan;
  plan.sorted = shared;
  plan.counts = plan.sorted + P;
  plan.key_start = plan.counts + (E + 1);
  plan.row_of = plan.key_start + (E + 2);
  plan.first_row = plan.row_of + N * T;
  plan.send_token = plan.first_row + (N + 1);
  plan.histogram = plan.send_token + N * T;
  plan.key = reinterpret_cast<int16_t*>(plan.histogram + HistogramInts(P, E));
  return plan;
}

// The placement's shared memory, over the plan's (which is done with by then).
struct Placement {
  int32_t* counts;  // [N][E_local] valid tags per (source, local expert)
  int32_t* source_major;  // [N][E_local] where block (i, e) starts, source-major
  int32_t* expert_major;  // [E_local][N] total + where block (e, i) starts, expert-major
  int32_t* packed_start;  // [N] 2 * total + where source i's received rows start, packed
  int32_t* delivered;  // [N] token rows each source delivered, clamped to [0, R]
  uint32_t* pair_of;  // [N * R * k] per expert-major row below the total: its list entry << 16 | its pair
  // (received row * k + choice, kNoPair if none); kNoRow where no entry maps to it
  int32_t* row_of_pair;  // [N * R * k] row_pairs: each pair's expert-major row, or N * C
  int32_t* row_of_source;  // [N * R * k] to_source_major below N * R * k (the rows past it are none)
};
constexpr uint32_t kNoPair = 0xffffu;
constexpr uint32_t kNoRow = 0xffffffffu;
static_assert(int64_t{kMaxNvlinkRanks} * kMaxMoeDispatchPairs < kNoPair, "a pair and a list entry take 16 bits");

// Tags a thread of the placement holds in registers: every tag of the call, kThreads apart.
constexpr int kTagsPerThread = static_cast<int>((kMaxNvlinkRanks * kMaxMoeDispatchPairs + kThreads - 1) / kThreads);

__host__ __device__ inline int64_t PlacementInts(int64_t N, int64_t E, int64_t entries) {
  return 3 * E + 2 * N + 3 * entries;
}

__device__ Placement LayOutPlacement(int32_t* shared, int32_t N, int32_t L, int32_t entries) {
  Placement placed;
  placed.counts = shared;
  placed.source_major = placed.counts + N * L;
  placed.expert_major = placed.source_major + N * L;
  placed.packed_start = placed.expert_major + N * L;
  placed.delivered = placed.packed_start + N;
  placed.pair_of = reinterpret_cast<uint32_t*>(placed.delivered + N);
  placed.row_of_pair = reinterpret_cast<int32_t*>(placed.pair_of + entries);
  placed.row_of_source = placed.row_of_pair + entries;
  return placed;
}

template <typename Rows, bool kLines>
__global__ void __launch_bounds__(kThreads) MoeDispatchKernel(Call call) {
  const MoeDispatchArgs& args = call.args;
  const Divisors& by = call.by;
  // The ids before anything else, in one batch: their loads overlap the set-up below, and the warp plan reads
  // them from shared memory rather than a global round trip per 32 pairs.
  const int32_t P = static_cast<int32_t>(args.tokens) * args.top_k;
  int32_t loaded[kIdsPerThread];
#pragma unroll
  for (int u = 0; u < kIdsPerThread; ++u) {
    const int32_t p = static_cast<int32_t>(threadIdx.x) + u * kThreads;
    loaded[u] = p < P ? args.expert_ids[p] : 0;
  }
  const uint64_t epoch = CallEpoch(args.control);
  const uint64_t flag = ScrambledLineFlag(epoch);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeDispatch, args.site,
                      args.timeout_ns);
  if (threadIdx.x == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  const bool profiled = args.phase_clocks != nullptr;
  auto stamp = [&](MoeDispatchPhase phase) {
    if (profiled && threadIdx.x == 0) args.phase_clocks[blockIdx.x * kMoeDispatchPhases + phase] = clock64();
  };
  stamp(kPhaseStart);
  const int32_t N = args.size, me = args.rank, k = args.top_k;
  const int32_t T = static_cast<int32_t>(args.tokens), E = static_cast<int32_t>(args.num_experts);
  const int32_t L = E / N, C = static_cast<int32_t>(min(args.capacity, int64_t{1} << 30));
  const int32_t R = min(C, T);
  const PlanSendsShape shape = args.plan_shape();
  const int32_t S = static_cast<int32_t>(shape.num_rows());
  const int32_t padded = static_cast<int32_t>(PaddedWords(k));
  const int32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int32_t thread = blockIdx.x * kThreads + tid, threads = gridDim.x * kThreads;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first_unit = int64_t{blockIdx.x} * kWarps + warp;
  // Vectors of 16 bytes: of a token row (tokens' dtype), of its bytes on the wire, of a slot row. With lines a
  // row's pieces count warp steps of lines (wire_lines.cuh), and an 8-bit wire row its blocks.
  const int64_t row_vectors = args.row_bytes / 16, wire_vectors = args.wire_row_bytes / 16;
  const int64_t slot_vectors = call.slot_row / 16;
  const int64_t row_words = args.row_bytes / 4, row_steps = RowLineSteps(args.wire, args.wire_row_bytes);
  const int32_t wire_blocks = static_cast<int32_t>(WireBlocks(args.wire_row_bytes));
  extern __shared__ int32_t shared[];
  __shared__ BlockScan::TempStorage scan;

  // The token rows into L2 while the plan is made (each block a share): the send reads them from there.
  const char* token_bytes = static_cast<const char*>(args.tokens_in);
  for (int64_t at = int64_t{thread} * 128; at < int64_t{T} * args.row_bytes; at += int64_t{threads} * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(token_bytes + at));
  }

  // ---- plan: plan_sends' arithmetic for this member, in shared memory ----
  const Plan plan = LayOutPlan(shared, P, E, N, T);
  const int32_t sort_warps = SortWarps(E), keys = E + 1;
  // Within the kWarpPlan* limits the pairs are sorted by comparing them (below) and warp 0 numbers the send rows
  // (four block barriers in all); past them every warp takes a share (about ten barriers and two block scans).
  const bool warp_plans = P <= kWarpPlanPairs && N * T <= kWarpPlanEntries && keys <= kWarpPlanKeys;
  int32_t* const sort_words = plan.histogram;  // with warp_plans: [P] key << 16 | pair, the pairs' order
  for (int32_t i = tid; !warp_plans && i < keys; i += kThreads) plan.counts[i] = 0;
  for (int32_t i = tid; !warp_plans && i < sort_warps * keys; i += kThreads) plan.histogram[i] = 0;
  for (int32_t i = tid; i < N * T; i += kThreads) plan.row_of[i] = 0;
  for (int32_t i = tid; i < S; i += kThreads) plan.send_token[i] = T;
#pragma unroll
  for (int u = 0; u < kIdsPerThread; ++u) {
    const int32_t p = tid + u * kThreads;
    if (p < P) {
      const int32_t key = RoutingKey(loaded[u], E);
      plan.key[p] = static_cast<int16_t>(key);
      if (warp_plans) sort_words[p] = key << 16 | p;
    }
  }
  __syncthreads();
  stamp(kPhaseCleared);
  if (warp_plans) {
    // Pair i's place in `sorted` is the number of sort words below its own, and key i's start the number below
    // i << 16: no shared counter, so no thread waits on another, and the order is stable by construction.
    // kComparers threads per index, each over every kComparers-th word, joined by shuffles.
    const int32_t part = lane % kComparers, indices = max(P, keys + 1);
    for (int32_t base = 0; base < indices; base += kThreads / kComparers) {
      const int32_t i = base + tid / kComparers;
      const int32_t own = i < P ? sort_words[i] : -1, start = i << 16;
      int32_t place = 0, below = 0;
#pragma unroll 8
      for (int32_t q = part; q < P; q += kComparers) {
        const int32_t word = sort_words[q];
        place += word < own;
        below += word < start;
      }
#pragma unroll
      for (int d = 1; d < kComparers; d *= 2) {
        place += __shfl_xor_sync(0xffffffffu, place, d);
        below += __shfl_xor_sync(0xffffffffu, below, d);
      }
      if (part == 0 && i < P) plan.sorted[place] = i;
      if (part == 0 && i <= keys) plan.key_start[i] = below;
    }
    stamp(kPhaseCounted);
  } else {
    for (int32_t p = tid; p < P; p += kThreads) atomicAdd(&plan.counts[plan.key[p]], 1);
    __syncthreads();
    stamp(kPhaseCounted);
    // A stable counting sort, as plan_sends' (moe_routing_kernels.cu): sort warp w walks pairs [w * chunk,
    // (w + 1) * chunk) with WalkSegment; the first lane of each key counts (then places) that key's lanes.
    const int32_t chunk = (P + sort_warps - 1) / sort_warps;
    const int32_t sort_begin = min(P, warp * chunk), sort_end = min(P, sort_begin + chunk);
    int32_t* histogram = plan.histogram + warp * keys;
    if (warp < sort_warps) {
      WalkSegment(args.expert_ids, E, sort_begin, sort_end, [&](int32_t, bool live, int32_t key, unsigned same) {
        if (live && lane == __ffs(same) - 1) histogram[key] += __popc(same);
      });
    }
    ScanBlock<kThreads>(
        keys, [&](int32_t e) { return plan.counts[e]; },
        [&](int32_t e, int32_t start, int32_t) { plan.key_start[e] = start; }, scan);
    if (tid == 0) plan.key_start[keys] = P;
    for (int32_t key = tid; key < keys; key += kThreads) {  // each sort warp's first place per key
      int32_t running = plan.key_start[key];
      for (int32_t w = 0; w < sort_warps; ++w) {
        const int32_t pairs = plan.histogram[w * keys + key];
        plan.histogram[w * keys + key] = running;
        running += pairs;
      }
    }
    __syncthreads();
    if (warp < sort_warps) {
      WalkSegment(args.expert_ids, E, sort_begin, sort_end, [&](int32_t pair, bool live, int32_t key, unsigned same) {
        const int32_t start = live ? histogram[key] : 0;
        __syncwarp();
        if (live && lane == __ffs(same) - 1) histogram[key] = start + __popc(same);
        __syncwarp();
        if (live) plan.sorted[start + __popc(same & LanesBelow())] = pair;
      });
    }
  }
  __syncthreads();
  stamp(kPhaseSorted);
  // Which pairs each member takes (its first C in the order), and the tokens that go to it.
  for (int32_t position = tid; position < P; position += kThreads) {
    const int32_t pair = plan.sorted[position], key = plan.key[pair];
    if (key < E) {
      const int32_t member = by.local.Div(key);
      if (position - plan.key_start[member * L] < C) plan.row_of[member * T + by.top_k.Div(pair)] = 1;
    }
  }
  __syncthreads();
  // Send rows numbered in (member, token) order: by warp 0, 32 entries a ballot, within kWarpPlanEntries; else
  // by a block scan.
  auto number = [&](int32_t i, int32_t row, int32_t goes) {
    const int32_t member = by.tokens.Div(i), token = i - member * T;
    if (token == 0) plan.first_row[member] = row;
    if (i == N * T - 1) plan.first_row[N] = row + goes;
    plan.row_of[i] = goes ? row : -1;
    if (goes) plan.send_token[row] = token;
  };
  if (warp_plans) {
    if (warp == 0) {
      int32_t rows_before = 0;
      for (int32_t base = 0; base < N * T; base += 32) {
        const int32_t i = base + lane;
        const int32_t goes = i < N * T ? plan.row_of[i] : 0;
        const unsigned going = __ballot_sync(0xffffffffu, goes);
        if (i < N * T) number(i, rows_before + __popc(going & LanesBelow()), goes);
        rows_before += __popc(going);
      }
    }
  } else {
    ScanBlock<kThreads>(N * T, [&](int32_t i) { return plan.row_of[i]; }, number, scan);
  }
  if (N * T == 0 && tid <= N) plan.first_row[tid] = 0;
  __syncthreads();
  stamp(kPhasePlanned);

  if (tid == 0) trace.Ready();

  // ---- send: each send row's token bytes, then its suffix, to row me * R + r of its member's slots ----
  // Tag `entry` of member m's list (the entry-th of its delivered pairs, or -1).
  auto tag_of = [&](int32_t m, int32_t entry) {
    const int32_t begin = plan.key_start[m * L];
    const int32_t delivered = min(C, plan.key_start[(m + 1) * L] - begin);
    if (entry >= delivered) return -1;
    const int32_t pair = plan.sorted[begin + entry], token = by.top_k.Div(pair);
    const int32_t row = plan.row_of[m * T + token] - plan.first_row[m];
    return (row * k + pair - token * k) * L + by.local.Mod(plan.key[pair]);
  };
  // Vectors [max(lo, wire_vectors), hi) of a slot row's suffix: its tags, then its weights.
  auto write_suffix = [&](uint4* to, int32_t m, int32_t r, int32_t token, int64_t lo, int64_t hi) {
    for (int64_t v = max(lo, wire_vectors) + lane; v < hi; v += 32) {
      int32_t word[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int32_t w = static_cast<int32_t>(v - wire_vectors) * 4 + u;
        if (w < padded) {
          word[u] = w < k ? tag_of(m, r * k + w) : -1;
        } else {
          word[u] = w - padded < k ? __float_as_int(args.weights[token * k + w - padded]) : 0;
        }
      }
      to[v] = make_uint4(word[0], word[1], word[2], word[3]);
    }
  };
  const int32_t sent_rows = plan.first_row[N];
  auto slot_row = [&](int32_t g, int32_t& m, int32_t& r) {  // send row g's member, its row there, its slot row
    m = 0;
    while (m + 1 < N && plan.first_row[m + 1] <= g) ++m;
    r = g - plan.first_row[m];
    return Slots(call.args.table, call.slot_base, m, parity) + call.rows_at + (int64_t{me} * R + r) * call.slot_row;
  };
  // This member's token count, in member tid's header (16 bytes a source): first, since every receiver polls
  // the counts before anything else.
  if (blockIdx.x == 0 && tid < N) {
    uint8_t* header = Slots(call.args.table, call.slot_base, tid, parity) + 16 * me;
    const int32_t count = plan.first_row[tid + 1] - plan.first_row[tid];
    if constexpr (kLines) {
      StoreVolatile(reinterpret_cast<Pair64*>(header), EntryOf(static_cast<uint32_t>(count), 0u, flag));
    } else {
      *reinterpret_cast<int32_t*>(header) = count;
    }
  }
  if constexpr (kLines) {
    // Entry i < R * k of member m's list, with the weight of choice i % k of row i / k, at me * R * k + i of its
    // entries: every one each call (-1 past the list), so that the receiver polls them all at once.
    for (int32_t i = thread; i < N * R * k; i += threads) {
      const int32_t m = by.per_source.Div(i), entry = i - m * R * k, r = by.top_k.Div(entry);
      const int32_t g = plan.first_row[m] + r;
      const uint32_t weight = args.with_weights && g < plan.first_row[m + 1]
                                  ? __float_as_uint(args.weights[plan.send_token[g] * k + entry - r * k])
                                  : 0u;
      Pair64* to = reinterpret_cast<Pair64*>(Slots(call.args.table, call.slot_base + call.entries_at, m, parity));
      StoreVolatile(to + int64_t{me} * R * k + entry, EntryOf(static_cast<uint32_t>(tag_of(m, entry)), weight, flag));
    }
    // The rows, kLineBatch steps loaded (or quantized) before they are stored as lines with the call's flag.
    const char* tokens = static_cast<const char*>(args.tokens_in);
    const Units send(sent_rows, row_steps, warps, 1);
    for (int64_t unit = first_unit; unit < send.count(); unit += warps) {
      const auto [row, lo, hi] = send.At(unit);
      const int32_t g = static_cast<int32_t>(row);
      int32_t m, r;
      Pair64* to = reinterpret_cast<Pair64*>(slot_row(g, m, r));
      WarpSendLineSteps<Rows, kLineBatch>(to, tokens + int64_t{plan.send_token[g]} * args.row_bytes, row_words,
                                          wire_blocks, lo, hi, flag);
    }
  } else if constexpr (kOnWire<Rows>) {
    // A warp per (row, kQuantizeBlocks blocks of values), and one more item per row for its suffix.
    using Token = typename WireOf<Rows>::Token;
    const int64_t hidden = args.row_bytes / static_cast<int64_t>(sizeof(Token));
    const int32_t groups = (wire_blocks + kQuantizeBlocks - 1) / kQuantizeBlocks, items = groups + 1;
    const Token* tokens = static_cast<const Token*>(args.tokens_in);
    for (int64_t item = first_unit; item < int64_t{sent_rows} * items; item += warps) {
      const int32_t g = static_cast<int32_t>(item / items), b = static_cast<int32_t>(item - int64_t{g} * items);
      int32_t m, r;
      uint8_t* row = slot_row(g, m, r);
      const int32_t token = plan.send_token[g];
      if (b < groups) {
        QuantizeBlocks<Token, WireOf<Rows>::kFormat>(row, tokens + token * hidden, b * kQuantizeBlocks, wire_blocks,
                                                     hidden, lane);
      } else {
        write_suffix(reinterpret_cast<uint4*>(row), m, r, token, wire_vectors, slot_vectors);
      }
    }
  } else {
    const uint4* tokens = static_cast<const uint4*>(args.tokens_in);
    const Units send(sent_rows, slot_vectors, warps);
    for (int64_t unit = first_unit; unit < send.count(); unit += warps) {
      const auto [row, lo, hi] = send.At(unit);
      const int32_t g = static_cast<int32_t>(row);
      int32_t m, r;
      uint4* to = reinterpret_cast<uint4*>(slot_row(g, m, r));
      const int32_t token = plan.send_token[g];
      WarpCopy<uint4, false>(to + lo, tokens + int64_t{token} * row_vectors + lo, min(hi, wire_vectors) - lo);
      write_suffix(to, m, r, token, lo, hi);
    }
  }
  if (profiled) __syncthreads();
  stamp(kPhaseSent);

  // The plan's results, each block its share: after the rows, which the peers wait for, and before the
  // barrier that ends the plan's use of shared memory.
  const PlanSendsResults& out = args.plan;
  for (int32_t position = thread; position < P; position += threads) {
    const int32_t pair = plan.sorted[position], key = plan.key[pair];
    int32_t slot = N * C;
    if (key < E) {
      const int32_t member = by.local.Div(key), offset = position - plan.key_start[member * L];
      if (offset < C) slot = member * C + offset;
    }
    out.order[position] = pair;
    out.return_slot[pair] = slot;
  }
  for (int32_t e = thread; e < E; e += threads) out.send_counts[e] = plan.key_start[e + 1] - plan.key_start[e];
  for (int32_t m = thread; m < N; m += threads) {
    const int32_t sent = plan.key_start[(m + 1) * L] - plan.key_start[m * L];
    out.dropped[m] = sent > C ? sent - C : 0;
    out.token_counts[m] = plan.first_row[m + 1] - plan.first_row[m];
  }
  for (int32_t i = thread; i < S; i += threads) out.send_token[i] = plan.send_token[i];
  for (int32_t i = thread; i < N * T; i += threads) {
    const int32_t member = by.tokens.Div(i), token = i - member * T, row = plan.row_of[i];
    out.return_row[token * N + member] = row >= 0 ? member * R + row - plan.first_row[member] : N * R;
  }
  __syncthreads();  // every thread's writes come before the releases; done with the plan
  if (!kLines && tid < N) StoreRelease(&args.table->control[tid]->arrived[me][blockIdx.x], epoch);
  if (tid == 0) trace.Sent();
  stamp(kPhaseResults);

  // ---- wait: with flags, every member's every block has written its rows here; with lines, the polls of the
  // counts and list entries below ----
  if constexpr (!kLines) {
    WaitForEveryBlock<kThreads>(patience, args.control, N, epoch);
    if (tid == 0) trace.DataArrived();
    stamp(kPhaseArrived);
  }

  // ---- place: place_received's arithmetic over the tags in this member's slots ----
  const uint8_t* mine = Slots(call.args.table, call.slot_base, me, parity);
  const uint8_t* rows = mine + call.rows_at;
  const Pair64* list_entries = reinterpret_cast<const Pair64*>(mine + call.entries_at);
  auto holds = [&](Pair64 entry) { return EntryHolds(entry, flag); };
  const int32_t per_source = R * k, entries = N * per_source, blocks = N * L, NC = N * C;
  auto suffix_word = [&](int32_t entry, int32_t word) {  // word `word` of the suffix of entry's received row
    return __ldcg(
        reinterpret_cast<const int32_t*>(rows + int64_t{by.top_k.Div(entry)} * call.slot_row + args.wire_row_bytes) +
        word);
  };
  // Weight of list entry `entry` (that of choice entry % k of received row entry / k); with lines, of an entry
  // this block has polled.
  auto weight_of = [&](int32_t entry) {
    if constexpr (kLines) return __uint_as_float(static_cast<uint32_t>(__ldcg(&list_entries[entry].hi)));
    return __int_as_float(suffix_word(entry, padded + by.top_k.Mod(entry)));
  };
  // One round of loads: the token counts, every tag (entry i of the list is tag i % k of received row i / k)
  // and this thread's share of the weights; rows past a source's data hold another call's bytes. With lines,
  // polls of each: kEntryBatch entries loaded, then each polled until it holds the call's flag.
  int32_t got = 0;
  if (tid < N) {
    const uint8_t* count = mine + 16 * tid;
    got = kLines ? static_cast<int32_t>(patience.Entry(reinterpret_cast<const Pair64*>(count), holds, tid).lo)
                 : __ldcg(reinterpret_cast<const int32_t*>(count));
  }
  // Each loop over them stops at this thread's count: fully unrolled, the empty iterations cost more issue
  // slots than the whole placement at decode sizes.
  const int32_t held = tid < entries ? (entries - 1 - tid) / kThreads + 1 : 0;
  int32_t tags[kTagsPerThread];
  if constexpr (kLines) {
#pragma unroll
    for (int u0 = 0; u0 < kTagsPerThread; u0 += kEntryBatch) {
      if (u0 >= held) break;
      Pair64 seen[kEntryBatch];
#pragma unroll
      for (int b = 0; b < kEntryBatch; ++b) {
        if (u0 + b < held) seen[b] = LoadVolatile(list_entries + tid + (u0 + b) * kThreads);
      }
#pragma unroll
      for (int b = 0; b < kEntryBatch; ++b) {
        if (u0 + b >= held) break;
        const int32_t entry = tid + (u0 + b) * kThreads;
        if (!holds(seen[b])) seen[b] = patience.Entry(list_entries + entry, holds, by.per_source.Div(entry));
        tags[u0 + b] = static_cast<int32_t>(seen[b].lo);
      }
    }
    if (tid == 0) trace.DataArrived();  // thread 0's counts and entries: the handshake's end
    stamp(kPhaseArrived);
  } else {
#pragma unroll
    for (int u = 0; u < kTagsPerThread; ++u) {
      if (u >= held) break;
      const int32_t entry = tid + u * kThreads;
      tags[u] = suffix_word(entry, by.top_k.Mod(entry));
    }
  }
  const int32_t weight_entry = args.with_weights ? thread : entries;
  const float first_weight = !kLines && weight_entry < entries ? weight_of(weight_entry) : 0.0f;
  const Placement placed = LayOutPlacement(shared, N, L, entries);
  for (int32_t i = tid; i < blocks; i += kThreads) placed.counts[i] = 0;
  if (tid < N) {
    placed.delivered[tid] = min(max(got, 0), R);
    if (blockIdx.x == 0) args.recv_tokens[tid] = got;
  }
  // A block whose waits gave up places nothing: the tags it read are another call's, and two of them could
  // claim one row of the inverses below (outputs are undefined then, but shared memory stays race-free).
  const bool gave_up = __syncthreads_or(patience.GaveUp());
#pragma unroll
  for (int u = 0; u < kTagsPerThread; ++u) {
    if (u >= held) break;
    const int32_t entry = tid + u * kThreads, source = by.per_source.Div(entry);
    if (!gave_up && by.top_k.Div(entry - source * per_source) < placed.delivered[source] && tags[u] >= 0) {
      atomicAdd(&placed.counts[source * L + by.local.Mod(tags[u])], 1);
    } else {
      tags[u] = -1;
    }
  }
  for (int32_t entry = weight_entry; entry < entries; entry += threads) {
    const int32_t source = by.per_source.Div(entry), row = by.top_k.Div(entry);
    const float weight = !kLines && entry == weight_entry ? first_weight : weight_of(entry);
    args.placed.recv_weights[entry] = (row - source * R) < placed.delivered[source] ? weight : 0.0f;
  }
  __syncthreads();
  const int32_t scanned = ScanBlock<kThreads>(
      2 * blocks + N,
      [&](int32_t i) {
        if (i < blocks) return placed.counts[i];
        if (i < 2 * blocks) return placed.counts[(i - blocks) % N * L + (i - blocks) / N];
        return placed.delivered[i - 2 * blocks];
      },
      [&](int32_t i, int32_t start, int32_t) { placed.source_major[i] = start; }, scan);
  const int32_t total = placed.expert_major[0], delivered = scanned - 2 * total;
  // Each valid tag's expert-major row x: its source's list is sorted by local expert, so entry j of source s
  // with expert e is row j - (where e starts in s's list) of block (e, s).
  for (int32_t x = tid; x < total; x += kThreads) placed.pair_of[x] = kNoRow;
  for (int32_t i = tid; i < entries; i += kThreads) {
    placed.row_of_pair[i] = NC;
    placed.row_of_source[i] = NC;
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kTagsPerThread; ++u) {
    if (u >= held) break;
    if (tags[u] < 0) continue;
    const int32_t entry = tid + u * kThreads, source = by.per_source.Div(entry), j = entry - source * per_source;
    const int32_t e = by.local.Mod(tags[u]), row = by.tags_per_row.Div(tags[u]);
    const int32_t x = placed.expert_major[e * N + source] - total + j -
                      (placed.source_major[source * L + e] - placed.source_major[source * L]);
    const uint32_t pair = row < R ? static_cast<uint32_t>((source * R + row) * k + by.top_k.Mod(by.local.Div(tags[u])))
                                  : kNoPair;
    if (x >= 0 && x < total) {
      placed.pair_of[x] = static_cast<uint32_t>(entry) << 16 | pair;
      if (pair != kNoPair) placed.row_of_pair[pair] = static_cast<int32_t>(x);
      const int32_t source_row = placed.source_major[source * L] + j;  // the same row, source-major (< total)
      if (source_row < NC) placed.row_of_source[source_row] = x;
    }
  }
  __syncthreads();
  stamp(kPhasePlaced);
  // row_pairs and to_source_major, each entry by one thread, from the inverses of pair_of above (the same in
  // every block): no block writes over another's entries, so none waits for another.
  for (int32_t i = thread; i < entries; i += threads) args.placed.row_pairs[i] = placed.row_of_pair[i];
  for (int32_t i = thread; i < NC; i += threads) {
    args.placed.to_source_major[i] = i < entries ? placed.row_of_source[i] : NC;
  }
  for (int32_t i = thread; i < blocks; i += threads) args.placed.recv_counts[i] = placed.counts[i];
  for (int32_t e = thread; e < L; e += threads) {
    int32_t sum = 0;
    for (int32_t source = 0; source < N; ++source) sum += placed.counts[source * L + e];
    args.placed.group_sizes[e] = sum;
  }
  // Placed row x's list entry (of = pair_of[x]): its source and its place j in that source's list.
  auto list_entry = [&](uint32_t of, int32_t& source, int32_t& j) {
    const int32_t list = static_cast<int32_t>(of >> 16);
    source = by.per_source.Div(list);
    j = list - source * per_source;
  };
  for (int32_t x = thread; x < NC; x += threads) {
    int32_t expand = N * R, entry = entries, expert_row = NC;
    const uint32_t of = x < total ? placed.pair_of[x] : kNoRow;
    if (of != kNoRow) {
      int32_t source, j;
      list_entry(of, source, j);
      if (j < C) expert_row = source * C + j;
      if ((of & kNoPair) != kNoPair) {
        entry = static_cast<int32_t>(of & kNoPair);
        expand = by.top_k.Div(entry);
      }
    }
    args.placed.expand_rows[x] = expand;
    args.placed.pair_entry[x] = entry;
    args.placed.to_expert_major[x] = expert_row;
  }
  for (int32_t s = thread; s < N * R; s += threads) {
    int32_t back = N * R;
    if (s < delivered) {
      const int32_t source = BlockAt(placed.packed_start, N, s + 2 * total);
      back = source * R + s + 2 * total - placed.packed_start[source];
    }
    args.placed.send_back_rows[s] = back;
  }

  // ---- expand: expert-major row x is a copy of its received row (zeros past the data) ----
  uint4* expert_rows = static_cast<uint4*>(args.expert_rows);
  const Units expand(NC, kLines ? row_steps : row_vectors, warps, kLines ? 1 : 32);
  [[maybe_unused]] bool live = true;  // with lines: false once a wait gave up; the call then reads what is there
  for (int64_t unit = first_unit; unit < expand.count(); unit += warps) {
    const auto [row, lo, hi] = expand.At(unit);
    const int32_t x = static_cast<int32_t>(row);
    const uint32_t of = x < total ? placed.pair_of[x] : kNoRow;
    const uint8_t* from = nullptr;
    const int32_t pair = static_cast<int32_t>(of & kNoPair);
    if (of != kNoRow && (of & kNoPair) != kNoPair) from = rows + int64_t{by.top_k.Div(pair)} * call.slot_row;
    uint4* to = expert_rows + int64_t{x} * row_vectors;
    if (from == nullptr) {
      if constexpr (kLines) {  // the row's vectors that steps [lo, hi) hold
        const int64_t first = StepVector<Rows>(lo, row_vectors);
        WarpZero(to + first, StepVector<Rows>(hi, row_vectors) - first);
      } else {
        WarpZero(to + lo, hi - lo);
      }
    } else if constexpr (kLines) {
      const int32_t source = by.per_source.Div(pair);
      WarpTakeLineSteps<Rows, kTakeBatch>(reinterpret_cast<const Pair64*>(from), to, row_words, wire_blocks, lo, hi,
                                          flag, [&](uint32_t spins) {
                                            return live = live && patience.WarpKeepsWaiting(spins, source);
                                          });
    } else {
      WarpTakeWireRow<Rows>(to, from, lo, hi, args.row_bytes);
    }
  }
  if (profiled) {
    __syncthreads();
    stamp(kPhaseEnd);
  }
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeDispatch);
}

// The most shared memory any call within the handlers' limits takes (SharedBytes' maximum over them).
constexpr int64_t kMostPlanBytes = (kMaxMoeDispatchPairs + 2 * kMaxRoutingExperts + 3 +
                                    2 * kMaxMoeDispatchMemberTokens + kMaxNvlinkRanks + 1 + kSortCounters + kWarps) *
                                       4 +
                                   kMaxMoeDispatchPairs * 2;
constexpr int64_t kMostPlacementBytes = (3 * kMaxRoutingExperts + 2 * kMaxNvlinkRanks +
                                         3 * int64_t{kMaxNvlinkRanks} * kMaxMoeDispatchPairs) *
                                        4;
constexpr size_t kMostSharedBytes = ((kMostPlanBytes > kMostPlacementBytes ? kMostPlanBytes : kMostPlacementBytes) +
                                     15) /
                                    16 * 16;
static_assert(kMostSharedBytes + sizeof(BlockScan::TempStorage) <= 227 * 1024, "past an sm_90 block's opt-in");

// Shared memory of a call's plan and placement (they share it), in bytes.
size_t SharedBytes(const MoeDispatchArgs& args) {
  const int64_t P = args.tokens * args.top_k, E = args.num_experts, N = args.size, T = args.tokens;
  const int64_t entries = N * std::min(args.capacity, T) * args.top_k;
  const int64_t plan_bytes = PlanInts(P, E, N, T) * 4 + P * 2;
  const int64_t place_bytes = PlacementInts(N, E, entries) * 4;
  return static_cast<size_t>((std::max(plan_bytes, place_bytes) + 15) / 16 * 16);
}

}  // namespace

int64_t MoeDispatchWireRowBytes(int64_t hidden, int64_t element_bytes, MoeWire wire) {
  if (wire == MoeWire::kNone) return hidden * element_bytes;
  const int64_t scales = hidden % kMoeWireBlock == 0 ? hidden / kMoeWireBlock : 1;  // else one for the row
  return hidden + 4 * scales;
}

int64_t MoeDispatchSlotRowBytes(int top_k, int64_t wire_row_bytes, bool with_weights) {
  return wire_row_bytes + SuffixWords(top_k, with_weights) * 4;
}

namespace {

// With lines: the list entries' bytes (N * R * k of 16 bytes) and a slot row's (whole warp steps of lines).
int64_t EntriesBytes(int size, int64_t rows_per_member, int top_k) {
  return (size * rows_per_member * top_k * 16 + 255) / 256 * 256;
}
int64_t LineRowBytes(MoeWire wire, int64_t wire_row_bytes) {
  return RowLineSteps(wire, wire_row_bytes) * kLineStepBytes;
}

bool LinesFit(int size, int64_t rows_per_member, MoeWire wire, int64_t wire_row_bytes) {
  return size * rows_per_member * LineRowBytes(wire, wire_row_bytes) <= kMoeLinesMaxBytes;
}

}  // namespace

bool MoeDispatchUsesLines(const MoeDispatchArgs& args) {
  return LinesFit(args.size, std::min(args.capacity, args.tokens), args.wire, args.wire_row_bytes);
}

int64_t MoeDispatchSlotBytes(int size, int64_t rows_per_member, int top_k, MoeWire wire, int64_t wire_row_bytes,
                             bool with_weights) {
  int64_t bytes = kHeaderBytes + size * rows_per_member * MoeDispatchSlotRowBytes(top_k, wire_row_bytes, with_weights);
  // Where lines fit, the larger of the two layouts (a call takes the lines, but the slots serve both).
  if (LinesFit(size, rows_per_member, wire, wire_row_bytes)) {
    bytes = std::max(bytes, kHeaderBytes + EntriesBytes(size, rows_per_member, top_k) +
                                size * rows_per_member * LineRowBytes(wire, wire_row_bytes));
  }
  return (NvlinkLowLatencyAreaBytes(size) + bytes + 255) / 256 * 256;
}

int ChooseMoeDispatchBlocks(const MoeDispatchArgs& args, int requested, int sm_count) {
  // A warp per line step (lines) or a thread per 16-byte vector (flags) of the larger side (the expert-major
  // rows written, or the rows sent), up to a block per SM (a block may wait for rows another block of its
  // grid writes, so all must be resident at once) and the flags.
  const int64_t R = std::min(args.capacity, args.tokens);
  const int64_t rows = std::max(args.size * args.capacity, args.size * R);
  const int64_t row_bytes = std::max(args.row_bytes, args.wire_row_bytes);
  const int64_t items = rows * (MoeDispatchSlotRowBytes(args.top_k, row_bytes, args.with_weights) / 16);
  const int64_t steps = RowLineSteps(args.wire, args.wire_row_bytes);
  const int64_t by_size = MoeDispatchUsesLines(args) ? (rows * steps + kWarps - 1) / kWarps
                                                     : (items + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeDispatchBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

cudaError_t LaunchMoeDispatch(const MoeDispatchArgs& args, int blocks, cudaStream_t stream) {
  const int64_t local = args.num_experts / args.size, R = std::min(args.capacity, args.tokens);
  const Divisors by{Divisor(args.top_k), Divisor(local), Divisor(args.tokens), Divisor(R * args.top_k),
                    Divisor(args.top_k * local)};
  const bool lines = MoeDispatchUsesLines(args);
  const int64_t entries_bytes = lines ? EntriesBytes(args.size, R, args.top_k) : 0;
  const Call call{args,
                  by,
                  NvlinkLowLatencyAreaBytes(args.size),
                  kHeaderBytes,
                  kHeaderBytes + entries_bytes,
                  lines ? LineRowBytes(args.wire, args.wire_row_bytes)
                        : MoeDispatchSlotRowBytes(args.top_k, args.wire_row_bytes, args.with_weights)};
  // The ids load kIdsPerThread a thread, and the placement holds every received tag in registers and packs
  // list entries in 16 bits: the handlers' limits (N <= 8, T * k <= kMaxMoeDispatchPairs) keep within all three;
  // a call past them is refused here too.
  if (args.size > kMaxNvlinkRanks || args.tokens * args.top_k > kMaxMoeDispatchPairs ||
      args.size * R * args.top_k > int64_t{kTagsPerThread} * kThreads) {
    return cudaErrorInvalidValue;
  }
  // Rows on the wire are whole vectors, as they are without an 8-bit wire, else whole blocks of the tokens.
  if (args.wire_row_bytes <= 0 || args.wire_row_bytes % 16 != 0 ||
      !WireRowMatches(args.wire, args.token_type, args.row_bytes, args.wire_row_bytes)) {
    return cudaErrorInvalidValue;
  }
  const size_t shared = SharedBytes(args);
  if (shared > kMostSharedBytes) return cudaErrorInvalidValue;
  return WithRows(args.wire, args.token_type, [&](auto rows) {
    using Rows = decltype(rows);
    if (lines) {
      return LaunchOptingIn(MoeDispatchKernel<Rows, true>, blocks, kThreads, shared, sizeof(BlockScan::TempStorage),
                            kMostSharedBytes, stream, call);
    }
    return LaunchOptingIn(MoeDispatchKernel<Rows, false>, blocks, kThreads, shared, sizeof(BlockScan::TempStorage),
                          kMostSharedBytes, stream, call);
  });
}

}  // namespace jax_ncclx
