// The NVLink kernels of the masked layout (see moe_masked.h for the algorithms and the slots).
//
// Dispatch, every block: count (each pair's rank among this member's pairs to its expert and each token's rank
// among the tokens sent to each member, in shared memory, the same in every block) in some warps while the
// others send a share of the rows, then the header, map and one flag per member, the token side's results (a
// share, while peers still send), wait (every member's every block), then the receive side: the layout of each
// expert's rows from the counts in the header, and a share of the [L, N * C] rows with their indices. Combine,
// every block: the expert side (a share of the rows with a pair, then one flag per member), wait, the token side
// (a share of the tokens' rows, weighted and added in float32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/device_sync.cuh"
#include "common/ll128_lines.cuh"
#include "common/symmetric_layout.h"
#include "common/warp_copy.cuh"
#include "common/wire_lines.cuh"
#include "common/wire_rows.cuh"
#include "ops/collectives/nvlink_collectives_kernels.h"
#include "ops/moe/moe_device.cuh"
#include "ops/moe/moe_masked.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Ids a dispatch thread loads at the start, all at once.
constexpr int kIdsPerThread = static_cast<int>(kMaxMoeMaskedPairs / kThreads);
static_assert(kMaxMoeMaskedPairs % kThreads == 0);
static_assert(kMaxMoeMaskedBlocks <= kMaxFlagGroups);
static_assert(kMaxMoeMaskedTopK <= 32, "a combine warp holds a token's choices on its lanes");
static_assert(kMaxMoeMaskedPairs < 32768 && kMaxRoutingExperts + 32 < 32768, "ids and ranks are kept in int16");
static_assert(int64_t{kMaxNvlinkRanks} * kMaxMoeMaskedPairs < (int64_t{1} << 31), "row_pair's s * P + p is int32");
static_assert(int64_t{kMaxNvlinkRanks} * kMaxMoeMaskedPairs < 32768, "token rows are counted in int16");
static_assert(kMaxMoeMaskedPairs <= 65536, "a map entry holds p | r << 16");
static_assert(kMaxNvlinkRanks <= 8, "a token's members are kept in a byte");

using BlockScan = cub::BlockScan<int32_t, kThreads>;

// Thread 0's clock64() at the end of `phase` of a profiled call (clocks [blocks, phases]), after a barrier:
// every thread of the block is past it. Unprofiled calls (clocks null, the same in every thread) skip both.
__device__ __forceinline__ void StampPhase(int64_t* clocks, int phases, int phase) {
  if (clocks == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) clocks[int64_t{blockIdx.x} * phases + phase] = clock64();
}

// ---- dispatch ----

// Calls of at most this many pairs are counted by one warp, 32 pairs a step with running counters per id;
// larger ones by up to half the warps, each over a contiguous range of pairs with its own histogram row of E
// counters (at most kCountCounters in all, so fewer warps for many experts), then a sum over the rows per id.
// The other warps send the rows meanwhile.
constexpr int32_t kWarpCountPairs = 256;
constexpr int64_t kCountCounters = 8192;
constexpr int32_t kMostCountWarps = kWarps / 2;
// 16-byte vectors a lane of a send warp loads before the count (see early_loaded).
constexpr int kEarlyVectors = 4;
// With lines: warp steps of lines loaded before any is stored (send) or polled (receive), so that their
// latencies overlap; the receive side takes 3, since 4 would spill there.
constexpr int kLineBatch = 4;
constexpr int kTakeBatch = 3;
static_assert(kLineBatch <= kEarlyVectors, "a send warp's early loads fill its first batch of lines");

__host__ __device__ constexpr int32_t CountWarps(int64_t pairs, int64_t num_experts) {
  return pairs <= kWarpCountPairs                         ? 1
         : kCountCounters / num_experts < 1               ? 1
         : kCountCounters / num_experts > kMostCountWarps ? kMostCountWarps
                                                          : static_cast<int32_t>(kCountCounters / num_experts);
}

// The shared memory of a dispatch block: int32 arrays, then int16 arrays, then a byte per token.
struct Counted {
  int32_t* counts;      // [E] pairs per id (the one-warp count's running counters)
  int32_t* histogram;   // [count warps][E] per warp and id: its pairs, then the id's pairs before the warp's
  int32_t* kept_start;  // [E] where each id's kept pairs start in send_pairs
  int32_t* recv;        // [N][L] kept pairs each source sent each local expert (the header, clamped to C)
  int32_t* start;       // [L][N] where source s's rows start in expert e's block: off(e, s)
  int32_t* group;       // [L] rows of each local expert
  int32_t* first_row;   // [N + 1] where member m's tokens start in token_row's count, then the total
  int32_t* delivered;   // [N] token rows each source sent (the header, clamped to R)
  int16_t* id;          // [P] each pair's id, or E for none
  int16_t* rank;        // [P] j: the pair's rank among this member's pairs with its id
  int16_t* token_row;   // [N * T] member-major: first_row[m] + r for the r-th token with a pair kept on m
  uint8_t* goes;        // [T] bit m: a pair of the token is kept for member m
};

__host__ __device__ constexpr int64_t HistogramInts(int64_t pairs, int64_t num_experts) {
  return pairs <= kWarpCountPairs ? 0 : CountWarps(pairs, num_experts) * num_experts;
}

__host__ __device__ constexpr int64_t CountedBytes(int64_t pairs, int64_t tokens, int64_t size, int64_t num_experts,
                                                   int64_t local_experts) {
  // counts, kept_start, recv and start take E each (N * L = E), group L, first_row N + 1 and delivered N.
  const int64_t ints = 4 * num_experts + HistogramInts(pairs, num_experts) + local_experts + 2 * size + 1;
  return (ints * 4 + pairs * 4 + tokens * (2 * size + 1) + 15) / 16 * 16;
}

// Past what any call within the limits takes: every expert local (L = E), every pair, a token per pair, N ranks.
constexpr int64_t kMostCountedBytes = CountedBytes(kMaxMoeMaskedPairs, kMaxMoeMaskedPairs, kMaxNvlinkRanks,
                                                   kMaxRoutingExperts, kMaxRoutingExperts);
static_assert(kMostCountedBytes + sizeof(BlockScan::TempStorage) <= 227 * 1024, "past an sm_90 block's opt-in");

__device__ Counted LayOutCounted(int32_t* shared, int32_t P, int32_t T, int32_t N, int32_t E, int32_t L) {
  Counted c;
  c.counts = shared;
  c.histogram = c.counts + E;
  c.kept_start = c.histogram + HistogramInts(P, E);
  c.recv = c.kept_start + E;
  c.start = c.recv + E;
  c.group = c.start + E;
  c.first_row = c.group + L;
  c.delivered = c.first_row + N + 1;
  c.id = reinterpret_cast<int16_t*>(c.delivered + N);
  c.rank = c.id + P;
  c.token_row = c.rank + P;
  c.goes = reinterpret_cast<uint8_t*>(c.token_row + N * T);
  return c;
}

struct DispatchCall {
  MoeMaskedDispatchArgs args;
  Divisor top_k, local, rows, tokens;  // k, L, N * C, T
  int64_t slot_base;       // where the counts start in a parity half: past the LL areas
  int64_t counts_bytes;    // CountsBytes: where the pair map starts
  int64_t header_bytes;    // HeaderBytes: where the rows start
  int64_t slot_row_bytes;  // a slot row's bytes: wire_row_bytes, or with lines whole warp steps of lines
};

// One block per SM is all a call takes (every block waits for every other): saying so leaves ptxas the
// registers to keep the whole kernel out of local memory. kLines: the counts and map entries
// carry their own flag and the rows travel as LL128 lines, so the receive side polls what it reads instead of
// waiting for every block of every member (moe_masked.h).
template <typename Rows, bool kLines>
__global__ void __launch_bounds__(kThreads, 1) MoeMaskedDispatchKernel(DispatchCall call) {
  const MoeMaskedDispatchArgs& args = call.args;
  const int32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int32_t T = static_cast<int32_t>(args.tokens), k = args.top_k, P = T * k;
  auto stamp = [&](MoeMaskedDispatchPhase phase) { StampPhase(args.phase_clocks, kMoeMaskedDispatchPhases, phase); };
  stamp(kMaskedDispatchStart);
  // The ids before anything else, in one batch: their loads overlap the set-up below.
  int32_t loaded[kIdsPerThread];
#pragma unroll
  for (int u = 0; u < kIdsPerThread; ++u) {
    const int32_t p = tid + u * kThreads;
    loaded[u] = p < P ? args.expert_ids[p] : -1;
  }
  const int32_t N = args.size, me = args.rank, E = static_cast<int32_t>(args.num_experts);
  // Warps below count_warps count; the others send the rows, a (token, member, piece) unit at a time.
  const int32_t count_warps = CountWarps(P, E), send_warps = kWarps - count_warps;  // per block
  const int64_t first_send = int64_t{blockIdx.x} * send_warps + warp - count_warps;
  const int64_t send_step = int64_t{gridDim.x} * send_warps;
  // Vectors of 16 bytes: of a token row (tokens' dtype), of its bytes on the wire (a slot row). With lines a
  // row's pieces count warp steps of lines (wire_lines.cuh), and an 8-bit wire row its blocks.
  const int64_t row_vectors = args.row_bytes / 16, wire_vectors = args.wire_row_bytes / 16;
  const int64_t row_words = args.row_bytes / 4, row_steps = RowLineSteps(args.wire, args.wire_row_bytes);
  const int32_t wire_blocks = static_cast<int32_t>(WireBlocks(args.wire_row_bytes));
  const bool flag_lane = lane % kLanesPerLine == kLanesPerLine - 1;
  const Units send_units(int64_t{T} * N, kLines ? row_steps : wire_vectors, send_step, kLines ? 1 : 32);
  // A send warp's first unit, loaded with the ids: its stores then wait for the ids alone, not for a second
  // round trip after the barrier that publishes the ids. Plain rows whose piece fits kEarlyVectors a lane.
  uint4 early[kEarlyVectors];
  const bool early_loaded = !kOnWire<Rows> && warp >= count_warps &&
                            send_units.piece_len <= (kLines ? kLineBatch : kEarlyVectors * 32) &&
                            first_send < send_units.count();
  if (early_loaded) {
    const auto [tm, lo, hi] = send_units.At(first_send);
    if constexpr (kLines) {
      const uint32_t* row = static_cast<const uint32_t*>(args.tokens_in) + tm / N * row_words;
#pragma unroll
      for (int u = 0; u < kLineBatch; ++u) {
        if (lo + u < hi) early[u] = LoadPayload(row, StepPart(lo + u, row_words));
      }
    } else {
      const uint4* row = static_cast<const uint4*>(args.tokens_in) + tm / N * row_vectors;
#pragma unroll
      for (int u = 0; u < kEarlyVectors; ++u) {
        if (lo + lane + 32 * u < hi) early[u] = row[lo + lane + 32 * u];
      }
    }
  }
  const uint64_t epoch = CallEpoch(args.control);
  const uint64_t flag = ScrambledLineFlag(epoch);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeMaskedDispatch, args.site,
                      args.timeout_ns);
  if (tid == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  const int32_t L = E / N, C = static_cast<int32_t>(args.capacity), NC = N * C;
  const int32_t R = min(T, L * C);  // token rows with a kept pair one source delivers to one member
  const int32_t thread = blockIdx.x * kThreads + tid, threads = gridDim.x * kThreads;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first_unit = int64_t{blockIdx.x} * kWarps + warp;
  extern __shared__ int4 shared_vectors[];  // int4: 16-byte aligned
  __shared__ BlockScan::TempStorage scan;
  const Counted counted = LayOutCounted(reinterpret_cast<int32_t*>(shared_vectors), P, T, N, E, L);

  // choice_rows' and choice_weights' "none" entries, before any block writes its rows' entries: with flags
  // every block's flag orders them (below); with lines each block raises its own arrival flag here, on this
  // rank alone, and every block sees them all before it writes an entry.
  auto fill_none = [&]() {
    for (int32_t i = thread; i < N * R * k; i += threads) {
      args.choice_rows[i] = L * NC;
      if (args.with_weights) args.choice_weights[i] = 0.0f;
    }
  };
  if constexpr (kLines) fill_none();

  // ---- count (warps below count_warps): j of every pair and the pairs per id; send (the other warps): the rows
  const bool one_warp = P <= kWarpCountPairs;
  for (int32_t i = tid; i < E; i += kThreads) counted.counts[i] = 0;
  for (int32_t i = tid; i < HistogramInts(P, E); i += kThreads) counted.histogram[i] = 0;
#pragma unroll
  for (int u = 0; u < kIdsPerThread; ++u) {
    const int32_t p = tid + u * kThreads;
    if (p < P) counted.id[p] = static_cast<int16_t>(RoutingKey(loaded[u], E));
  }
  __syncthreads();
  // By a send warp's thread: the release waits for the fill, which the count warps must not.
  if (kLines && tid == kThreads - 1) StoreReleaseGpu(&args.control->arrived[me][blockIdx.x], epoch);
  // Pairs [begin, end) 32 at a time, with running counters per id: the first lane of each id adds that id's
  // lanes, each lane's rank is the counter before plus its lanes below. Lanes without an id match nobody.
  auto count_run = [&](int32_t* counters, int32_t begin, int32_t end) {
    for (int32_t base = begin; base < end; base += 32) {
      const int32_t p = base + lane;
      const int32_t id = p < end ? counted.id[p] : E;
      const bool live = id < E;
      const unsigned same = __match_any_sync(0xffffffffu, live ? id : E + lane);
      const int32_t before = live ? counters[id] : 0;
      __syncwarp();
      if (live && lane == __ffs(same) - 1) counters[id] = before + __popc(same);
      if (p < end) counted.rank[p] = static_cast<int16_t>(live ? before + __popc(same & LanesBelow()) : 0);
      __syncwarp();
    }
  };
  // Token t's row once to each member that one of its ids names, kept or not (the count is not known yet; a
  // row sent for dropped pairs only is never read, as the receiver reads the rows the map names): row me * T + t
  // of the member's slots. A warp per (token, member, piece), the warps the count leaves.
  auto slot_row = [&](int32_t m, int32_t t) {
    return Slots(args.table, call.slot_base + call.header_bytes, m, parity) +
           (int64_t{me} * T + t) * call.slot_row_bytes;
  };
  // Whether token t has an id on member m, the same on every lane.
  auto reaches = [&](int32_t t, int32_t m) {
    const int32_t id = lane < k ? counted.id[t * k + lane] : E;
    return __any_sync(0xffffffffu, id < E && call.local.Div(id) == m);
  };
  auto send = [&](int64_t first, int64_t step) {
    const int32_t sends = T * N;  // (token, member) units, member-minor
    if constexpr (kLines) {
      // kLineBatch steps of the row loaded (or quantized), then stored as lines with the call's flag.
      const char* tokens = static_cast<const char*>(args.tokens_in);
      int64_t unit = first;
      if (early_loaded) {  // the first unit's steps, all in `early`
        const auto [row, lo, hi] = send_units.At(unit);
        const int32_t t = static_cast<int32_t>(row) / N, m = static_cast<int32_t>(row) - t * N;
        if (reaches(t, m)) {
          Pair64* to = reinterpret_cast<Pair64*>(slot_row(m, t)) + lane;
          __syncwarp();  // a line's 8 lanes store it in one instruction
#pragma unroll
          for (int b = 0; b < kLineBatch; ++b) {
            if (lo + b < hi) StoreVolatile(to + (lo + b) * kStepParts, PartOf(early[b], flag_lane, flag));
          }
        }
        unit += step;
      }
      for (; unit < send_units.count(); unit += step) {
        const auto [row, lo, hi] = send_units.At(unit);
        const int32_t t = static_cast<int32_t>(row) / N, m = static_cast<int32_t>(row) - t * N;
        if (!reaches(t, m)) continue;
        WarpSendLineSteps<Rows, kLineBatch>(reinterpret_cast<Pair64*>(slot_row(m, t)),
                                            tokens + int64_t{t} * args.row_bytes, row_words, wire_blocks, lo, hi, flag);
      }
    } else if constexpr (kOnWire<Rows>) {
      // A warp per (token, member, kQuantizeBlocks blocks of values).
      using Token = typename WireOf<Rows>::Token;
      const int64_t hidden = args.row_bytes / static_cast<int64_t>(sizeof(Token));
      const int32_t groups = (wire_blocks + kQuantizeBlocks - 1) / kQuantizeBlocks;
      const Token* tokens = static_cast<const Token*>(args.tokens_in);
      for (int64_t item = first; item < int64_t{sends} * groups; item += step) {
        const int32_t tm = static_cast<int32_t>(item / groups), b = static_cast<int32_t>(item - int64_t{tm} * groups);
        const int32_t t = tm / N, m = tm - t * N;
        if (!reaches(t, m)) continue;
        QuantizeBlocks<Token, WireOf<Rows>::kFormat>(slot_row(m, t), tokens + int64_t{t} * hidden, b * kQuantizeBlocks,
                                                     wire_blocks, hidden, lane);
      }
    } else {
      const uint4* tokens = static_cast<const uint4*>(args.tokens_in);
      for (int64_t unit = first; unit < send_units.count(); unit += step) {
        const auto [row, lo, hi] = send_units.At(unit);
        const int32_t tm = static_cast<int32_t>(row), t = tm / N, m = tm - t * N;
        if (!reaches(t, m)) continue;
        uint4* to = reinterpret_cast<uint4*>(slot_row(m, t)) + lo;
        if (early_loaded && unit == first) {
#pragma unroll
          for (int u = 0; u < kEarlyVectors; ++u) {
            if (lo + lane + 32 * u < hi) to[lane + 32 * u] = early[u];
          }
        } else {
          WarpCopy<uint4, false>(to, tokens + int64_t{t} * row_vectors + lo, hi - lo);
        }
      }
    }
  };
  if (warp >= count_warps) send(first_send, send_step);
  if (one_warp) {
    if (warp == 0) count_run(counted.counts, 0, P);
  } else {
    const int32_t chunk = (P + count_warps - 1) / count_warps;
    if (warp < count_warps) {
      count_run(counted.histogram + warp * E, min(P, warp * chunk), min(P, warp * chunk + chunk));
    }
    __syncthreads();
    for (int32_t id = tid; id < E; id += kThreads) {  // each warp's first rank per id, and the totals
      int32_t running = 0;
      for (int32_t w = 0; w < count_warps; ++w) {
        const int32_t pairs = counted.histogram[w * E + id];
        counted.histogram[w * E + id] = running;
        running += pairs;
      }
      counted.counts[id] = running;
    }
    __syncthreads();
    for (int32_t p = tid; p < P; p += kThreads) {
      const int32_t id = counted.id[p];
      if (id < E) counted.rank[p] = static_cast<int16_t>(counted.rank[p] + counted.histogram[p / chunk * E + id]);
    }
  }
  __syncthreads();
  for (int32_t t = tid; t < T; t += kThreads) {  // the members each token goes to
    uint32_t goes = 0;
    for (int32_t c = 0; c < k; ++c) {
      const int32_t id = counted.id[t * k + c];
      if (id < E && counted.rank[t * k + c] < C) goes |= 1u << call.local.Div(id);
    }
    counted.goes[t] = static_cast<uint8_t>(goes);
  }
  if (N * T == 0 && tid <= N) counted.first_row[tid] = 0;
  __syncthreads();
  if (tid == 0) trace.Ready();
  stamp(kMaskedDispatchCounted);

  // ---- send: the token rows' ranks (while the rows' stores drain), this member's counts into every member's
  // header and the pair map ----
  // Each token's rank among the tokens sent to each member, member-major: the order of this member's token
  // rows on every member, and of combine's rows back.
  ScanBlock<kThreads>(
      N * T,
      [&](int32_t i) { return static_cast<int32_t>(counted.goes[call.tokens.Mod(i)] >> call.tokens.Div(i) & 1u); },
      [&](int32_t i, int32_t start, int32_t goes) {
        counted.token_row[i] = static_cast<int16_t>(start);
        if (call.tokens.Mod(i) == 0) counted.first_row[call.tokens.Div(i)] = start;
        if (i == N * T - 1) counted.first_row[N] = start + goes;
      },
      scan);
  // r of token t among those with a pair kept on member m (t must be one).
  auto row_rank = [&](int32_t m, int32_t t) { return counted.token_row[m * T + t] - counted.first_row[m]; };
  // Entry i of member m's counts: an int32, or with lines a 16-byte {value, flag} entry.
  auto put_count = [&](int32_t m, int32_t i, int32_t value) {
    uint8_t* header = Slots(args.table, call.slot_base, m, parity);
    if constexpr (kLines) {
      StoreVolatile(reinterpret_cast<Pair64*>(header) + i, EntryOf(static_cast<uint32_t>(value), 0u, flag));
    } else {
      reinterpret_cast<int32_t*>(header)[i] = value;
    }
  };
  if (blockIdx.x == 0) {
    for (int32_t id = tid; id < E; id += kThreads) {
      const int32_t m = call.local.Div(id);
      put_count(m, me * L + id - m * L, min(counted.counts[id], C));
    }
    for (int32_t m = tid; m < N; m += kThreads) put_count(m, E + me, counted.first_row[m + 1] - counted.first_row[m]);
  }
  // Each kept pair's {p | r << 16, weight} into its member's map, at (me, e, j): the receiver's index of the
  // rows, and where the pair's token row is among those from this member.
  for (int32_t p = thread; p < P; p += threads) {
    const int32_t id = counted.id[p], j = counted.rank[p];
    if (id >= E || j >= C) continue;
    const int32_t m = call.local.Div(id), e = id - m * L;
    uint8_t* map = Slots(args.table, call.slot_base + call.counts_bytes, m, parity);
    const int64_t at = (int64_t{me} * L + e) * C + j;
    const uint32_t index = static_cast<uint32_t>(p | row_rank(m, call.top_k.Div(p)) << 16);
    const uint32_t weight = args.with_weights ? __float_as_uint(args.weights[p]) : 0u;
    if constexpr (kLines) {
      StoreVolatile(reinterpret_cast<Pair64*>(map) + at, EntryOf(index, weight, flag));
    } else {
      reinterpret_cast<int2*>(map)[at] = make_int2(static_cast<int32_t>(index), static_cast<int32_t>(weight));
    }
  }
  if constexpr (!kLines) {
    fill_none();
    __syncthreads();  // every thread's writes come before the releases
    if (tid < N) StoreRelease(&args.table->control[tid]->arrived[me][blockIdx.x], epoch);
  }
  stamp(kMaskedDispatchSent);

  // ---- the token side's results, each block its share, while the peers' rows come ----
  const int32_t kept = ScanBlock<kThreads>(
      E, [&](int32_t id) { return min(counted.counts[id], C); },
      [&](int32_t id, int32_t start, int32_t) { counted.kept_start[id] = start; }, scan);
  for (int32_t p = thread; p < P; p += threads) {
    const int32_t id = counted.id[p], j = counted.rank[p];
    const bool is_kept = id < E && j < C;
    args.pair_slot[p] = is_kept ? id * C + j : E * C;  // id * C + j = (m * L + e) * C + j
    if (is_kept) args.send_pairs[counted.kept_start[id] + j] = p;
  }
  for (int32_t i = kept + thread; i < P; i += threads) args.send_pairs[i] = P;
  for (int32_t id = thread; id < E; id += threads) args.send_counts[id] = min(counted.counts[id], C);
  for (int64_t m = first_unit; m < N; m += warps) {  // a warp per member
    int32_t over = 0;
    for (int32_t e = lane; e < L; e += 32) over += max(counted.counts[m * L + e] - C, 0);
    over = __reduce_add_sync(0xffffffffu, over);
    if (lane == 0) args.dropped[m] = over;
  }
  for (int32_t i = thread; i < T * N; i += threads) {
    const int32_t t = i / N, m = i - t * N;
    args.return_row[i] = counted.goes[t] >> m & 1u ? m * R + row_rank(m, t) : N * R;
  }
  // The trace's "sent" after this rank's own work, as the packed kernel's: its handshake is then the wait alone.
  if (tid == 0) trace.Sent();
  stamp(kMaskedDispatchResults);

  // ---- wait: with flags, every member's every block has written its rows and its header here; with lines,
  // every member's counts are here (polled one entry a thread) and every block of this rank filled its share
  // of the "none" entries ----
  const uint8_t* mine = Slots(args.table, call.slot_base, me, parity);
  // Clamped: a stale header (a wait that gave up) must not take the rows past the slots.
  auto take_count = [&](int32_t i, int32_t value) {
    if (i < E) {
      counted.recv[i] = min(max(value, 0), C);
    } else {
      counted.delivered[i - E] = min(max(value, 0), R);
    }
  };
  auto holds = [&](Pair64 entry) { return EntryHolds(entry, flag); };
  if constexpr (kLines) {
    // This rank's flags first: raised at the blocks' starts, they are in by now, and the counts come later.
    for (int32_t b = tid; b < static_cast<int32_t>(gridDim.x); b += kThreads) {
      patience.AtLeast(&args.control->arrived[me][b], epoch, me);
    }
    const Pair64* header = reinterpret_cast<const Pair64*>(mine);
    for (int32_t i = tid; i < E + N; i += kThreads) {
      const int32_t source = i < E ? call.local.Div(i) : i - E;
      take_count(i, static_cast<int32_t>(patience.Entry(header + i, holds, source).lo));
    }
    __syncthreads();
  } else {
    WaitForEveryBlock<kThreads>(patience, args.control, N, epoch);
    const int32_t* header = reinterpret_cast<const int32_t*>(mine);
    for (int32_t i = tid; i < E + N; i += kThreads) take_count(i, __ldcg(header + i));
    __syncthreads();
  }
  if (tid == 0) trace.DataArrived();
  stamp(kMaskedDispatchArrived);

  // ---- receive: each expert's rows source by source ----
  const uint8_t* map = mine + call.counts_bytes;
  const uint8_t* rows = mine + call.header_bytes;
  for (int32_t e = tid; e < L; e += kThreads) {
    int32_t running = 0;
    for (int32_t s = 0; s < N; ++s) {
      counted.start[e * N + s] = running;
      running += counted.recv[s * L + e];
    }
    counted.group[e] = running;
  }
  __syncthreads();
  for (int32_t i = thread; i < E; i += threads) args.recv_counts[i] = counted.recv[i];
  for (int32_t e = thread; e < L; e += threads) args.group_sizes[e] = counted.group[e];
  for (int32_t s = thread; s < N; s += threads) args.recv_tokens[s] = counted.delivered[s];
  for (int32_t q = thread; q < N * R; q += threads) {  // the token rows, packed source-major, for combine's way back
    int32_t back = N * R, start = 0;
    for (int32_t s = 0; s < N; start += counted.delivered[s++]) {
      if (q < start + counted.delivered[s]) {
        back = s * R + q - start;
        break;
      }
    }
    args.send_back_rows[q] = back;
  }
  stamp(kMaskedDispatchIndexed);
  // Row i < group[e] of expert e comes from the last source whose rows start at or before it (empty sources
  // start where their successor does), as its j-th row: the map's entry (s, e, j) names its pair and token.
  // A warp per (row, piece) of the [L, N * C] rows loads the entry once (every lane the same word), then the
  // slot row; the row's first piece also writes its indices (row_pair, recv_weights, choice_rows).
  uint4* expert_rows = static_cast<uint4*>(args.expert_rows);
  const int64_t total_rows = int64_t{L} * NC;
  const int32_t none = N * P;
  const Units expand(total_rows, kLines ? row_steps : row_vectors, warps, kLines ? 1 : 32);
  [[maybe_unused]] bool live = true;  // with lines: false once a wait gave up; the call then reads what is there
  for (int64_t unit = first_unit; unit < expand.count(); unit += warps) {
    const auto [x, lo, hi] = expand.At(unit);
    const int32_t e = call.rows.Div(static_cast<int32_t>(x)), i = static_cast<int32_t>(x) - e * NC;
    uint4* to = expert_rows + x * row_vectors;
    if (i >= counted.group[e]) {  // the same on every lane
      if (lo == 0 && lane == 0) {
        args.row_pair[x] = none;
        if (args.with_weights) args.recv_weights[x] = 0.0f;
      }
      if constexpr (kLines) {  // the row's vectors that steps [lo, hi) hold
        const int64_t first = StepVector<Rows>(lo, row_vectors);
        WarpZero(to + first, StepVector<Rows>(hi, row_vectors) - first);
      } else {
        WarpZero(to + lo, hi - lo);
      }
      continue;
    }
    const int32_t s = BlockAt(counted.start + e * N, N, i);
    const int64_t entry = (int64_t{s} * L + e) * C + i - counted.start[e * N + s];
    int2 word;
    if constexpr (kLines) {
      const Pair64 seen = patience.Entry(reinterpret_cast<const Pair64*>(map) + entry, holds, s);
      word = make_int2(static_cast<int32_t>(seen.lo), static_cast<int32_t>(seen.hi));
    } else {
      word = __ldcg(reinterpret_cast<const int2*>(map) + entry);
    }
    const int32_t p = word.x & 0xFFFF, r = static_cast<int32_t>(static_cast<uint32_t>(word.x) >> 16);
    if (lo == 0 && lane == 0) {
      args.row_pair[x] = s * P + p;
      if (args.with_weights) args.recv_weights[x] = __int_as_float(word.y);
      if (p < P && r < R) {  // a stale entry (a wait that gave up) writes nowhere
        const int64_t at = (int64_t{s} * R + r) * k + call.top_k.Mod(p);
        args.choice_rows[at] = static_cast<int32_t>(x);
        if (args.with_weights) args.choice_weights[at] = __int_as_float(word.y);
      }
    }
    // Clamped: a stale entry (a wait that gave up) must not take the copy past the slots.
    const uint32_t t = static_cast<uint32_t>(p) / static_cast<uint32_t>(k);
    const uint8_t* from = rows + (int64_t{s} * T + min(t, static_cast<uint32_t>(T - 1))) * call.slot_row_bytes;
    if constexpr (kLines) {
      WarpTakeLineSteps<Rows, kTakeBatch>(reinterpret_cast<const Pair64*>(from), to, row_words, wire_blocks, lo, hi,
                                          flag, [&](uint32_t spins) {
                                            return live = live && patience.WarpKeepsWaiting(spins, s);
                                          });
    } else {
      WarpTakeWireRow<Rows>(to, from, lo, hi, args.row_bytes);
    }
  }
  stamp(kMaskedDispatchEnd);
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeMaskedDispatch);
}

// ---- combine ----

// Choices of a token loaded together on the token side (their rows' latencies overlap).
constexpr int kChunk = 8;

struct CombineCall {
  MoeMaskedCombineArgs args;
  Divisor local;      // L: the expert side walks the rows i-major
  int64_t slot_base;  // where the slots start in a parity half: past the LL areas
};

template <typename Element>
__global__ void __launch_bounds__(kThreads) MoeMaskedCombineKernel(CombineCall call) {
  using V = Lanes<Element>;
  const MoeMaskedCombineArgs& args = call.args;
  auto stamp = [&](MoeMaskedCombinePhase phase) { StampPhase(args.phase_clocks, kMoeMaskedCombinePhases, phase); };
  stamp(kMaskedCombineStart);
  const uint64_t epoch = CallEpoch(args.control);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeMaskedCombine, args.site,
                      args.timeout_ns);
  if (threadIdx.x == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  const int32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int32_t N = args.size, me = args.rank, k = args.top_k, T = static_cast<int32_t>(args.tokens);
  const int32_t P = T * k, none = N * P;
  const int32_t L = static_cast<int32_t>(args.local_experts), NC = static_cast<int32_t>(args.expert_rows);
  const int64_t total_rows = int64_t{L} * NC;
  const int64_t vectors = args.hidden / V::kCount;  // per row
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first_unit = int64_t{blockIdx.x} * kWarps + warp;
  const uint4* expert_out = static_cast<const uint4*>(args.expert_out);
  auto slot_row = [&](int owner, int32_t p) {
    return reinterpret_cast<uint4*>(Slots(args.table, call.slot_base, owner, parity)) + int64_t{p} * vectors;
  };

  // Expert side. Units of (row, piece) as many as the rows with a pair could take (at most N * P), walking the
  // rows i-major (row i of every expert, then row i + 1), so that the rows with a pair, each expert's first,
  // come first and spread over every warp. Each lane reads the row_pair of one of the warp's next 32 units,
  // so that the units without a pair cost one load for 32.
  const Units expert(min(total_rows, int64_t{none}), vectors, warps);
  const int64_t expert_units = total_rows * expert.pieces;
  for (int64_t base = first_unit; base < expert_units; base += 32 * warps) {
    const int64_t looked = base + lane * warps;
    int32_t x = 0, tag = none;
    if (looked < expert_units) {
      const int32_t walked = static_cast<int32_t>(looked / expert.pieces);  // i * L + e
      const int32_t i = call.local.Div(walked), e = walked - i * L;
      x = e * NC + i;
      tag = args.row_pair[x];
    }
    for (unsigned live = __ballot_sync(0xffffffffu, tag >= 0 && tag < none); live != 0; live &= live - 1) {
      const int from_lane = __ffs(live) - 1;
      const int64_t unit = base + from_lane * warps;
      const int32_t row = __shfl_sync(0xffffffffu, x, from_lane), pair = __shfl_sync(0xffffffffu, tag, from_lane);
      const int64_t lo = unit % expert.pieces * expert.piece_len, hi = min(vectors, lo + expert.piece_len);
      const int32_t s = pair / P;
      WarpCopy<uint4, false>(slot_row(s, pair - s * P) + lo, expert_out + int64_t{row} * vectors + lo, hi - lo);
    }
  }
  __syncthreads();  // every thread's writes come before the releases
  if (tid < N) StoreRelease(&args.table->control[tid]->arrived[me][blockIdx.x], epoch);
  if (tid == 0) trace.Sent();
  stamp(kMaskedCombineSent);

  // Token side: a warp per (token, piece); lane c holds choice c's slot and weight. The first unit's are
  // loaded before the wait: pair_slot and weights are inputs, not peer data.
  const Units token(T, vectors, warps);
  const int64_t token_units = int64_t{T} * token.pieces;
  auto choice = [&](int64_t unit, int32_t& slot, float& w) {
    slot = -1;
    w = 0.0f;
    if (unit >= token_units || lane >= k) return;
    const int64_t pair = unit / token.pieces * k + lane;
    slot = args.pair_slot[pair];
    w = args.weights[pair];
  };
  int32_t first_slot;
  float first_weight;
  choice(first_unit, first_slot, first_weight);
  WaitForEveryBlock<kThreads>(patience, args.control, N, epoch);
  if (tid == 0) trace.DataArrived();
  stamp(kMaskedCombineArrived);

  // Per warp: the kept choices' pairs and weights, in choice order.
  __shared__ int32_t kept_pairs[kWarps][32];
  __shared__ float kept_weights[kWarps][32];
  uint4* out = static_cast<uint4*>(args.out);
  for (int64_t unit = first_unit; unit < token_units; unit += warps) {
    const int32_t t = static_cast<int32_t>(unit / token.pieces);
    const int64_t lo = (unit - int64_t{t} * token.pieces) * token.piece_len;
    const int64_t hi = min(vectors, lo + token.piece_len);
    int32_t slot = first_slot;
    float w = first_weight;
    if (unit != first_unit) choice(unit, slot, w);
    const unsigned kept = __ballot_sync(0xffffffffu, slot >= 0 && slot < total_rows);
    if (kept >> lane & 1u) {
      const int at = __popc(kept & LanesBelow());
      kept_pairs[warp][at] = t * k + lane;
      kept_weights[warp][at] = w;
    }
    __syncwarp();
    const int n = __popc(kept);
    for (int64_t v = lo + lane; v < hi; v += 32) {
      float acc[V::kCount] = {};
      for (int c0 = 0; c0 < n; c0 += kChunk) {
        uint4 in[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (c0 + u < n) in[u] = __ldcg(slot_row(me, kept_pairs[warp][c0 + u]) + v);
        }
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (c0 + u >= n) continue;
          float f[V::kCount];
          V::ToFloat(in[u], f);
          const float cw = kept_weights[warp][c0 + u];
#pragma unroll
          for (int l = 0; l < V::kCount; ++l) acc[l] = __fmaf_rn(cw, f[l], acc[l]);  // as XLA contracts the chain's
        }
      }
      out[int64_t{t} * vectors + v] = V::FromFloat(acc);
    }
    __syncwarp();  // the list stays until every lane is done with it
  }
  stamp(kMaskedCombineEnd);
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeMaskedCombine);
}

int64_t Saturated(int64_t a, int64_t b) {
  int64_t product;
  return __builtin_mul_overflow(a, b, &product) ? std::numeric_limits<int64_t>::max() : product;
}

int64_t SaturatedAdd(int64_t a, int64_t b) {
  int64_t sum;
  return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<int64_t>::max() : sum;
}

int64_t Align256(int64_t bytes) {
  return bytes > std::numeric_limits<int64_t>::max() - 255 ? std::numeric_limits<int64_t>::max() / 256 * 256
                                                           : (bytes + 255) / 256 * 256;
}

// The dispatch slots' counts: [N][L] int32 and [N] token rows (with lines 16-byte entries), rounded up to 256
// bytes.
int64_t CountsBytes(int size, int64_t local_experts, bool lines) {
  return Align256(Saturated(int64_t{size} * (lines ? 16 : 4), SaturatedAdd(local_experts, 1)));
}

// The counts, then the pair map: [N][L][C] int2 {p | r << 16, weight bits} (with lines 16-byte entries, the
// int2 then the flag), rounded up to 256 bytes.
int64_t HeaderBytes(int size, int64_t local_experts, int64_t capacity, bool lines) {
  const int64_t entries = Saturated(Saturated(local_experts, size), capacity);
  return SaturatedAdd(CountsBytes(size, local_experts, lines), Align256(Saturated(entries, lines ? 16 : 8)));
}

// Bytes of a slot row: the wire's, or whole warp steps of lines.
int64_t SlotRowBytes(MoeWire wire, int64_t wire_row_bytes, bool lines) {
  return lines ? Saturated(RowLineSteps(wire, wire_row_bytes), kLineStepBytes) : wire_row_bytes;
}

// Whether a call's size lets it take lines.
bool LinesFit(int size, int64_t tokens, MoeWire wire, int64_t wire_row_bytes) {
  return Saturated(Saturated(tokens, size), SlotRowBytes(wire, wire_row_bytes, true)) <= kMoeLinesMaxBytes;
}

}  // namespace

bool MoeMaskedDispatchUsesLines(const MoeMaskedDispatchArgs& args) {
  return LinesFit(args.size, args.tokens, args.wire, args.wire_row_bytes);
}

int64_t MoeMaskedDispatchSlotBytes(int size, int64_t tokens, int64_t local_experts, int64_t capacity, MoeWire wire,
                                   int64_t wire_row_bytes) {
  // Lines wherever they fit: their layout takes more than the flags'.
  const bool lines = tokens >= 0 && wire_row_bytes >= 0 && LinesFit(size, tokens, wire, wire_row_bytes);
  const int64_t rows = Saturated(Saturated(tokens, size), SlotRowBytes(wire, wire_row_bytes, lines));
  return Align256(
      SaturatedAdd(SaturatedAdd(NvlinkLowLatencyAreaBytes(size), HeaderBytes(size, local_experts, capacity, lines)),
                   rows));
}

int64_t MoeMaskedCombineSlotBytes(int64_t pairs, int64_t hidden, int element_bytes) {
  const int64_t rows = Saturated(Saturated(pairs, hidden), element_bytes);
  return Align256(SaturatedAdd(NvlinkLowLatencyAreaBytes(kMaxNvlinkRanks), rows));
}

size_t MoeMaskedDispatchSharedBytes(const MoeMaskedDispatchArgs& args) {
  return static_cast<size_t>(
      CountedBytes(args.tokens * args.top_k, args.tokens, args.size, args.num_experts, args.num_experts / args.size));
}

int ChooseMoeMaskedDispatchBlocks(const MoeMaskedDispatchArgs& args, int requested, int sm_count) {
  // A thread per 16-byte vector of the larger side (the slot rows sent, at most one per pair and one per
  // (token, member), or the expert rows written), up to a block per SM and the flags.
  const int64_t sent = std::min(args.tokens * args.top_k, args.tokens * args.size);
  const int64_t rows = args.num_experts * args.capacity;  // L * N * C
  const int64_t items = std::max(sent * (args.wire_row_bytes / 16), rows * (args.row_bytes / 16));
  const int64_t by_size = (items + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeMaskedBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

int ChooseMoeMaskedCombineBlocks(const MoeMaskedCombineArgs& args, int requested, int sm_count) {
  // A thread per 16-byte vector of the larger side: the rows with a pair (at most N * P) or the tokens.
  const int64_t vectors = args.hidden * FloatTypeBytes(args.type) / 16;  // per row
  const int64_t pairs = args.tokens * args.top_k;
  const int64_t rows = std::min(args.local_experts * args.expert_rows, int64_t{args.size} * pairs);
  const int64_t items = std::max(rows, args.tokens) * vectors;
  const int64_t by_size = (items + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeMaskedBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

cudaError_t LaunchMoeMaskedDispatch(const MoeMaskedDispatchArgs& args, int blocks, cudaStream_t stream) {
  const int64_t N = args.size, E = args.num_experts, C = args.capacity, P = args.tokens * args.top_k;
  // The kernel's int32 indices and shared memory hold within these (the handlers check them too).
  if (N < 1 || N > kMaxNvlinkRanks || args.rank < 0 || args.rank >= N || args.top_k < 1 ||
      args.top_k > kMaxMoeMaskedTopK || args.tokens < 0 || P > kMaxMoeMaskedPairs || E < 1 || E % N != 0 ||
      E > kMaxRoutingExperts || C < 1 || E * C > kMaxCapacity || blocks < 1 || blocks > kMaxMoeMaskedBlocks) {
    return cudaErrorInvalidValue;
  }
  // Rows are whole vectors, and travel as they are without an 8-bit wire, else as whole blocks of the tokens.
  if (args.row_bytes < 0 || args.row_bytes % 16 != 0 || args.wire_row_bytes < 0 || args.wire_row_bytes % 16 != 0 ||
      !WireRowMatches(args.wire, args.token_type, args.row_bytes, args.wire_row_bytes)) {
    return cudaErrorInvalidValue;
  }
  const bool lines = MoeMaskedDispatchUsesLines(args);
  const DispatchCall call{args,
                          Divisor(args.top_k),
                          Divisor(E / N),
                          Divisor(N * C),
                          Divisor(args.tokens),
                          NvlinkLowLatencyAreaBytes(args.size),
                          CountsBytes(args.size, E / N, lines),
                          HeaderBytes(args.size, E / N, C, lines),
                          SlotRowBytes(args.wire, args.wire_row_bytes, lines)};
  const size_t shared = MoeMaskedDispatchSharedBytes(args);
  if (shared > static_cast<size_t>(kMostCountedBytes)) return cudaErrorInvalidValue;
  return WithRows(args.wire, args.token_type, [&](auto rows) {
    using Rows = decltype(rows);
    if (lines) {
      return LaunchOptingIn(MoeMaskedDispatchKernel<Rows, true>, blocks, kThreads, shared,
                            sizeof(BlockScan::TempStorage), kMostCountedBytes, stream, call);
    }
    return LaunchOptingIn(MoeMaskedDispatchKernel<Rows, false>, blocks, kThreads, shared,
                          sizeof(BlockScan::TempStorage), kMostCountedBytes, stream, call);
  });
}

cudaError_t LaunchMoeMaskedCombine(const MoeMaskedCombineArgs& args, int blocks, cudaStream_t stream) {
  const int64_t N = args.size, L = args.local_experts, P = args.tokens * args.top_k;
  if (N < 1 || N > kMaxNvlinkRanks || args.rank < 0 || args.rank >= N || args.top_k < 1 ||
      args.top_k > kMaxMoeMaskedTopK || args.tokens < 0 || P > kMaxMoeMaskedPairs || L < 0 || args.expert_rows < 0 ||
      (L > 0 && args.expert_rows > kMaxCapacity / L) || args.hidden < 0 ||
      args.hidden * FloatTypeBytes(args.type) % 16 != 0 || blocks < 1 || blocks > kMaxMoeMaskedBlocks) {
    return cudaErrorInvalidValue;
  }
  const CombineCall call{args, Divisor(L), NvlinkLowLatencyAreaBytes(args.size)};
  switch (args.type) {
    case FloatType::kF32:
      MoeMaskedCombineKernel<float><<<blocks, kThreads, 0, stream>>>(call);
      break;
    case FloatType::kBF16:
      MoeMaskedCombineKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(call);
      break;
    case FloatType::kF16:
      MoeMaskedCombineKernel<__half><<<blocks, kThreads, 0, stream>>>(call);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace jax_ncclx
