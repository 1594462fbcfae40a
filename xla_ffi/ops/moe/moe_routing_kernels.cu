// Device kernels of the moe routing ops and their launchers. Device code only: the XLA handlers that drive
// them live in moe_routing_cuda.cc.
//
// Each call runs on one thread block cluster per batch element (sm_90): one block at MoE decode sizes, up to
// 8 at prefill sizes, where one SM alone would take ~100 µs (its __match_any_sync throughput above all).
// The blocks of a cluster read each other's counters through distributed shared memory. Every phase ends
// at a cluster barrier, which also orders the phase's global memory writes for the next phase.
//
// Blocks have 256, 512 or 1024 threads, more for more work per block (BlockThreads). At decode sizes a
// phase costs each warp its index arithmetic whether it has items or not, and the SM issues it for every
// warp: plan_sends at T = 16 (128 pairs) took 8.4 µs with 1024 threads and 6.6 with 256, place_received
// 7.0 and 5.8 (tools/time_routing_kernels.cu on one H200, builds with one block size forced, 2 members, 16
// experts, top-8). At prefill sizes 1024 threads are fastest (plan_sends at T = 4096: 32.8 µs against 42.4
// with 256).
#include "ops/moe/moe_routing_kernels.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "ops/moe/moe_device.cuh"

namespace jax_ncclx {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxThreads = 1024;
constexpr int kMaxClusterBlocks = 8;            // the portable cluster size
constexpr int64_t kWorkPerBlock = 4096;         // pairs (or tag entries) per block before a call takes another
constexpr int64_t kSharedBytes = 48 * 1024;     // a block's shared memory, static and dynamic, without an opt-in

template <int kThreads>
struct ScanShared {
  typename cub::BlockScan<int32_t, kThreads>::TempStorage storage;
  int32_t block_total;
};

// Indices are int32 throughout (the handlers check that they fit): 64-bit division is slow on GPUs.
__device__ inline int32_t Min(int32_t a, int32_t b) { return a < b ? a : b; }

// The divisors of a plan_sends call.
struct PlanSendsDivisors {
  Divisor top_k, local_experts, tokens, capacity, suffix_words, segments, sort_warps;
};

// The divisors of a place_received call.
struct PlaceReceivedDivisors {
  Divisor top_k, local_experts, members, per_source, tags_per_row;  // per_source = R * k, tags_per_row = k * E_local
};

// Barriers and shared memory of a cluster that may be a single block, where the plain block-local forms serve.
struct Cluster {
  cg::cluster_group group = cg::this_cluster();
  int32_t blocks = group.num_blocks();
  int32_t rank = group.block_rank();
  __device__ void Sync() {
    if (blocks > 1) {
      group.sync();
    } else {
      __syncthreads();
    }
  }
  // Block r's copy of `local`, a pointer into this block's shared memory.
  __device__ int32_t* Shared(int32_t* local, int r) { return blocks > 1 ? group.map_shared_rank(local, r) : local; }
};

// Exclusive prefix sums of value(0), ..., value(n - 1). Across the cluster: block r of Q takes the r-th of
// Q contiguous ranges (then the call ends at a cluster barrier); otherwise every block scans all of them.
// Each thread takes a contiguous run of its block's range and calls emit(i, sum of the values before i,
// value(i)) along it, in order. value(i) is read twice; emit(i, ...) may overwrite what value(i) reads,
// nothing else may change in between. Returns the total to every thread.
template <int kThreads, typename Value, typename Emit>
__device__ int32_t Scan(Cluster& cluster, int32_t n, bool across_cluster, Value value, Emit emit,
                        ScanShared<kThreads>& shared) {
  across_cluster = across_cluster && cluster.blocks > 1;
  const int32_t blocks = across_cluster ? cluster.blocks : 1, rank = across_cluster ? cluster.rank : 0;
  const int32_t per_block = across_cluster ? (n + blocks - 1) / blocks : n;
  const int32_t block_begin = Min(n, rank * per_block), block_end = Min(n, block_begin + per_block);
  const int32_t per_thread = (block_end - block_begin + kThreads - 1) / kThreads;
  const int32_t begin = Min(block_end, block_begin + static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = Min(block_end, begin + per_thread);
  int32_t sum = 0;
  for (int32_t i = begin; i < end; ++i) sum += value(i);
  int32_t running = 0, total = 0;
  cub::BlockScan<int32_t, kThreads>(shared.storage).ExclusiveSum(sum, running, total);
  if (across_cluster) {
    if (threadIdx.x == 0) shared.block_total = total;
    cluster.Sync();
    total = 0;
    for (int r = 0; r < blocks; ++r) {
      const int32_t block_total = *cluster.Shared(&shared.block_total, r);
      running += r < rank ? block_total : 0;
      total += block_total;
    }
  }
  for (int32_t i = begin; i < end; ++i) {
    const int32_t v = value(i);
    emit(i, running, v);
    running += v;
  }
  if (across_cluster) {
    cluster.Sync();  // emit's writes are visible, and nobody reads shared.block_total any more
  } else {
    __syncthreads();
  }
  return total;
}

// Calls apply(i, load(i)) for i = first, first + stride, ... below n, the loads of kBatch of them issued
// before their applies: a loop whose body stores waits a memory round trip per iteration otherwise, as the
// compiler does not move loads above stores it cannot prove disjoint.
template <int kBatch = 4, typename Load, typename Apply>
__device__ void Strided(int32_t first, int32_t n, int32_t stride, Load load, Apply apply) {
  for (int64_t base = first; base < n; base += kBatch * stride) {
    decltype(load(0)) loaded[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * stride < n) loaded[u] = load(static_cast<int32_t>(base + u * stride));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * stride < n) apply(static_cast<int32_t>(base + u * stride), loaded[u]);
    }
  }
}

// A stable counting sort of the pairs by key: the pairs split into one contiguous segment per sorting warp
// of the cluster (sort_warps per block, rank-major), each warp walks its own, and lanes with equal keys find
// each other with __match_any_sync, so the order within a key is segment order, then lane order. Pass 1
// counts each key per warp; a scan over (key, segment) gives where each warp's pairs of each key start;
// pass 2 places the pairs. The per-warp counters take 2 * sort_warps * (E + 1) ints of shared memory, so
// fewer warps sort when there are many experts.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    PlanSendsKernel(PlanSendsShape shape, int sort_warps, bool row_of_in_shared, PlanSendsDivisors by,
                    const int32_t* __restrict__ expert_ids, const float* __restrict__ all_weights, PlanSendsResults out,
                    int32_t* __restrict__ scratch) {
  Cluster cluster;
  const int32_t blocks = cluster.blocks, rank = cluster.rank;
  const int32_t E = shape.num_experts, N = shape.num_members, local = shape.local_experts();
  const int32_t C = shape.capacity, T = shape.num_tokens, k = shape.top_k;
  const int32_t P = shape.num_pairs(), S = shape.num_rows(), NT = N * T;
  const int64_t b = blockIdx.x;
  const int32_t* __restrict__ ids = expert_ids + b * P;
  int32_t* __restrict__ order = out.order + b * P;
  int32_t* __restrict__ return_slot = out.return_slot + b * P;
  int32_t* __restrict__ send_token = out.send_token + b * S;
  const int32_t words = shape.suffix_words(), padded = PaddedWords(k);
  int32_t* __restrict__ suffix = out.send_suffix + b * S * words;
  extern __shared__ int32_t shared[];
  int32_t* counters = shared;                            // [sort_warps][E + 1] this block's warps' counts
  int32_t* starts = counters + sort_warps * (E + 1);     // [sort_warps][E + 1] where they go in the order
  int32_t* key_start = starts + sort_warps * (E + 1);    // [E + 2] where each key starts in the order
  int32_t* first_row = key_start + E + 2;                // [N + 1] each member's first send row
  // Per (member, token): first 1 if the token goes to the member, then its send row (or -1). In shared memory
  // when one block does the call and it fits (decode sizes), which saves three phases a global round trip.
  int32_t* __restrict__ row_of = row_of_in_shared ? first_row + N + 1 : scratch + b * NT;
  __shared__ ScanShared<kThreads> scan;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int32_t thread = rank * kThreads + tid, threads = blocks * kThreads;  // in the cluster
  for (int32_t i = tid; i < sort_warps * (E + 1); i += kThreads) counters[i] = 0;
  for (int32_t i = tid; i <= N; i += kThreads) first_row[i] = 0;  // stays so without tokens
  if (tid == 0) key_start[E + 1] = P;
  for (int32_t i = thread; i < NT; i += threads) row_of[i] = 0;
  for (int32_t i = thread; i < S; i += threads) send_token[i] = T;
  // The suffixes' tag words -1, their weight words 0, 16 bytes per store where the buffer allows (suffix_words
  // and padded are multiples of 4, so each 16 bytes are all tags or all weights).
  if (reinterpret_cast<uintptr_t>(suffix) % sizeof(int4) == 0) {
    for (int32_t i = thread; i < S * words / 4; i += threads) {
      const int32_t word = by.suffix_words.Mod(4 * i) < padded ? -1 : 0;
      reinterpret_cast<int4*>(suffix)[i] = make_int4(word, word, word, word);
    }
  } else {
    for (int32_t i = thread; i < S * words; i += threads) suffix[i] = by.suffix_words.Mod(i) < padded ? -1 : 0;
  }
  __syncthreads();

  const int32_t segments = blocks * sort_warps;
  const int32_t per_segment = (P + 32 * segments - 1) / (32 * segments) * 32;  // whole chunks of 32
  const int32_t segment_begin = Min(P, (rank * sort_warps + warp) * per_segment);
  const int32_t segment_end = Min(P, segment_begin + per_segment);
  int32_t* my_counters = counters + warp * (E + 1);
  int32_t* my_starts = starts + warp * (E + 1);
  if (warp < sort_warps) {
    WalkSegment(ids, E, segment_begin, segment_end, [&](int32_t, bool live, int32_t key, unsigned same) {
      if (live && lane == __ffs(same) - 1) my_counters[key] += __popc(same);
    });
  }
  cluster.Sync();

  // (key, segment) in order: each segment's start goes to its block's `starts`, each key's to every block.
  Scan(
      cluster, (E + 1) * segments, /*across_cluster=*/true,
      [&](int32_t j) {
        const int32_t key = by.segments.Div(j), segment = by.segments.Mod(j);
        return cluster.Shared(counters, by.sort_warps.Div(segment))[by.sort_warps.Mod(segment) * (E + 1) + key];
      },
      [&](int32_t j, int32_t start, int32_t) {
        const int32_t key = by.segments.Div(j), segment = by.segments.Mod(j);
        cluster.Shared(starts, by.sort_warps.Div(segment))[by.sort_warps.Mod(segment) * (E + 1) + key] = start;
        if (segment == 0) {
          for (int r = 0; r < blocks; ++r) cluster.Shared(key_start, r)[key] = start;
        }
      },
      scan);
  if (rank == 0) {
    for (int32_t e = tid; e < E; e += kThreads) out.send_counts[b * E + e] = key_start[e + 1] - key_start[e];
    for (int32_t m = tid; m < N; m += kThreads) {
      const int32_t sent = key_start[(m + 1) * local] - key_start[m * local];
      out.dropped[b * N + m] = sent > C ? sent - C : 0;
    }
  }

  if (warp < sort_warps) {
    WalkSegment(ids, E, segment_begin, segment_end, [&](int32_t pair, bool live, int32_t key, unsigned same) {
      const int32_t start = live ? my_starts[key] : 0;
      __syncwarp();
      if (live && lane == __ffs(same) - 1) my_starts[key] = start + __popc(same);
      __syncwarp();
      if (!live) return;
      const int32_t position = start + __popc(same & LanesBelow());
      order[position] = pair;
      int32_t slot = N * C;
      if (key < E) {
        const int32_t member = by.local_experts.Div(key), offset = position - key_start[member * local];
        if (offset < C) {  // the member takes its first C pairs in the order
          slot = member * C + offset;
          row_of[member * T + by.top_k.Div(pair)] = 1;
        }
      }
      return_slot[pair] = slot;
    });
  }
  cluster.Sync();

  // Send rows: member-major, tokens ascending within a member. Each member's first row goes to every block.
  Scan(
      cluster, NT, /*across_cluster=*/true, [&](int32_t i) { return row_of[i]; },
      [&](int32_t i, int32_t row, int32_t goes) {
        if (by.tokens.Mod(i) == 0) {
          for (int r = 0; r < blocks; ++r) cluster.Shared(first_row, r)[by.tokens.Div(i)] = row;
        }
        if (i == NT - 1) {
          for (int r = 0; r < blocks; ++r) cluster.Shared(first_row, r)[N] = row + goes;
        }
        row_of[i] = goes ? row : -1;
      },
      scan);

  if (rank == 0) {
    for (int32_t m = tid; m < N; m += kThreads) out.token_counts[b * N + m] = first_row[m + 1] - first_row[m];
  }
  const int32_t R = shape.rows_per_member();
  for (int32_t i = thread; i < NT; i += threads) {
    const int32_t row = row_of[i], member = by.tokens.Div(i), token = by.tokens.Mod(i);
    const bool sent = row >= 0 && row < S;
    if (sent) send_token[row] = token;
    out.return_row[(b * T + token) * N + member] = sent ? member * R + row - first_row[member] : N * R;
  }
  // The sent rows' tokens' weights, as bits: word j of row i's weights is thread i * k + j's, so that a warp's
  // stores fill whole suffixes (a thread per row storing its k words took ~3.2 of plan_sends' 10.5 µs at
  // T = 128 with 4 members, clock stamps on one H200).
  if (all_weights != nullptr) {
    Strided(
        thread, NT * k, threads,
        [&](int32_t w) {
          const int32_t i = by.top_k.Div(w);
          return make_int2(row_of[i], __float_as_int(all_weights[(b * T + by.tokens.Mod(i)) * k + w - i * k]));
        },
        [&](int32_t w, int2 loaded) {
          if (loaded.x >= 0 && loaded.x < S) suffix[loaded.x * words + padded + by.top_k.Mod(w)] = loaded.y;
        });
  }
  // Member m's tag entries, from row first_row[m]: its delivered pairs in the order (a pair's return slot
  // is m * C + its place among them), each as the token's row (counted from m's first row), the pair's
  // choice and its local expert.
  for (int32_t pair = thread; pair < P; pair += threads) {
    const int32_t slot = return_slot[pair];
    if (slot >= N * C) continue;
    const int32_t member = by.capacity.Div(slot), entry = first_row[member] * k + by.capacity.Mod(slot);
    const int32_t row = row_of[member * T + by.top_k.Div(pair)] - first_row[member];
    if (entry < S * k) {
      suffix[by.top_k.Div(entry) * words + by.top_k.Mod(entry)] = (row * k + by.top_k.Mod(pair)) * local +
                                                                  by.local_experts.Mod(ids[pair]);
    }
  }
}

// Counts the valid tags per (source, local expert) (each block of the cluster a share, then summed through
// distributed shared memory) while copying out the router weights, scans the counts in source-major and
// expert-major order (every block for itself), and walks the N * C expert-major rows, each finding its block
// by binary search and writing its indices and its entry of the inverse table row_pairs; then the packed
// send-back rows.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    PlaceReceivedKernel(PlaceReceivedShape shape, PlaceReceivedDivisors by, const uint8_t* __restrict__ all_received,
                        const int32_t* __restrict__ all_recv_tokens, PlaceReceivedResults out) {
  Cluster cluster;
  const int32_t cluster_blocks = cluster.blocks, rank = cluster.rank;
  const int32_t N = shape.num_members, R = shape.rows_per_source, k = shape.top_k;
  const int32_t local = shape.local_experts, C = shape.capacity;
  const int32_t blocks = N * local, per_source = R * k, rows = N * C, entries = N * per_source;
  const int64_t b = blockIdx.x;
  const uint8_t* __restrict__ received = all_received + b * N * R * shape.row_bytes;
  // Entry i of the tags, read as one list: tag i % k in the suffix of received row i / k.
  auto tag_at = [&](int32_t i) {
    return SuffixWord(received + by.top_k.Div(i) * shape.row_bytes + shape.suffix_offset, by.top_k.Mod(i));
  };
  const int32_t* __restrict__ recv_tokens = all_recv_tokens + b * N;
  int32_t* __restrict__ expand_rows = out.expand_rows + b * rows;
  int32_t* __restrict__ to_expert_major = out.to_expert_major + b * rows;
  int32_t* __restrict__ to_source_major = out.to_source_major + b * rows;
  int32_t* __restrict__ pair_entry = out.pair_entry + b * rows;
  int32_t* __restrict__ row_pairs = out.row_pairs + b * entries;
  int32_t* __restrict__ send_back_rows = out.send_back_rows + b * N * R;

  extern __shared__ int32_t shared[];
  int32_t* my_counts = shared;                      // [N][E_local] this block's share of the tags
  int32_t* cluster_counts = my_counts + blocks;     // [N][E_local] the cluster's, when it has several blocks
  // One scan fills the next three arrays (see below), so the second and third hold their starts plus the
  // totals of the arrays before them.
  int32_t* source_major = cluster_counts + blocks;  // [N][E_local] where block (i, e) starts, source-major
  int32_t* expert_major = source_major + blocks;    // [E_local][N] total + where block (e, i) starts, expert-major
  int32_t* packed_start = expert_major + blocks;    // [N] 2 * total + where source i's received rows start, packed
  __shared__ ScanShared<kThreads> scan;

  const int tid = threadIdx.x;
  const int32_t thread = rank * kThreads + tid, threads = cluster_blocks * kThreads;
  for (int32_t i = tid; i < blocks; i += kThreads) my_counts[i] = 0;
  __syncthreads();
  // The count pass also copies the router weights out of the same suffixes and initializes row_pairs: as a
  // loop of their own after the rows, they cost place_received 0.5-0.85 µs more (kernel-only, one H200).
  for (int32_t entry = thread; entry < entries; entry += threads) {
    const uint8_t* suffix = received + by.top_k.Div(entry) * shape.row_bytes + shape.suffix_offset;
    const int32_t source = by.per_source.Div(entry), tag = SuffixWord(suffix, by.top_k.Mod(entry));
    if (shape.with_weights) {
      out.recv_weights[b * entries + entry] = __int_as_float(SuffixWord(suffix, PaddedWords(k) + by.top_k.Mod(entry)));
    }
    row_pairs[entry] = rows;  // before the barrier below
    if (by.top_k.Div(by.per_source.Mod(entry)) < recv_tokens[source] && tag >= 0) {
      atomicAdd(&my_counts[source * local + by.local_experts.Mod(tag)], 1);
    }
  }
  cluster.Sync();
  const int32_t* counts = my_counts;
  if (cluster_blocks > 1) {
    for (int32_t i = tid; i < blocks; i += kThreads) {
      int32_t sum = 0;
      for (int r = 0; r < cluster_blocks; ++r) sum += cluster.Shared(my_counts, r)[i];
      cluster_counts[i] = sum;
    }
    cluster.Sync();  // also: no block leaves while another reads its share
    counts = cluster_counts;
  }

  // One scan over the counts source-major, the same counts expert-major and the rows delivered by each source,
  // rather than three: a scan costs ~0.3 µs at any of these lengths. `total` = valid tags = each count array's sum.
  const int32_t scanned = Scan(
      cluster, 2 * blocks + N, /*across_cluster=*/false,
      [&](int32_t i) {
        if (i < blocks) return counts[i];
        if (i < 2 * blocks) return counts[by.members.Mod(i - blocks) * local + by.members.Div(i - blocks)];
        return min(max(recv_tokens[i - 2 * blocks], 0), R);
      },
      [&](int32_t i, int32_t start, int32_t) { source_major[i] = start; }, scan);
  const int32_t total = expert_major[0], delivered = scanned - 2 * total;

  if (rank == 0) {
    for (int32_t i = tid; i < blocks; i += kThreads) out.recv_counts[b * blocks + i] = counts[i];
    for (int32_t e = tid; e < local; e += kThreads) {
      int32_t sum = 0;
      for (int32_t source = 0; source < N; ++source) sum += counts[source * local + e];
      out.group_sizes[b * local + e] = sum;
    }
  }
  for (int32_t x = thread; x < rows; x += threads) {
    int32_t expand = N * R, entry = entries, expert_row = rows, source_row = rows;
    if (x < total) {
      const int32_t j = BlockAt(expert_major, blocks, x + total);
      const int32_t e = by.members.Div(j), source = by.members.Mod(j);
      // Source i's tags list its pairs sorted by expert: expert e's start after its earlier experts'.
      const int32_t in_list = source_major[source * local + e] - source_major[source * local] + x + total -
                              expert_major[j];
      if (in_list < C) expert_row = source * C + in_list;
      const int32_t tag = tag_at(source * per_source + in_list);  // (row * k + choice) * E_local + local expert
      if (tag >= 0 && by.tags_per_row.Div(tag) < R) {
        expand = source * R + by.tags_per_row.Div(tag);
        entry = expand * k + by.top_k.Mod(by.local_experts.Div(tag));
        row_pairs[entry] = x;
      }
      const int32_t i = BlockAt(source_major, blocks, x);
      source_row = min(expert_major[by.local_experts.Mod(i) * N + by.local_experts.Div(i)] - total + x -
                           source_major[i],
                       rows);
    }
    expand_rows[x] = expand;
    pair_entry[x] = entry;
    to_expert_major[x] = expert_row;
    to_source_major[x] = source_row;
  }
  for (int32_t s = thread; s < N * R; s += threads) {
    int32_t back = N * R;
    if (s < delivered) {
      const int32_t source = BlockAt(packed_start, N, s + 2 * total);
      back = source * R + s + 2 * total - packed_start[source];
    }
    send_back_rows[s] = back;
  }
}

// Launches `kernel` on one cluster of `cluster_blocks` blocks of `threads` threads per batch element (grid x:
// batch, y: cluster).
template <typename... Params, typename... Args>
cudaError_t LaunchClusters(void (*kernel)(Params...), int64_t batch, int cluster_blocks, int threads,
                           size_t shared_bytes, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(batch), cluster_blocks, 1);
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = cluster_blocks;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, args...);
  return cudaGetLastError();  // which also clears a failed launch's error, so that no later op reports it
}

// Blocks per cluster for `work` items: one per kWorkPerBlock, at most kMaxClusterBlocks.
int ClusterBlocks(int64_t work) {
  return static_cast<int>(std::clamp<int64_t>((work + kWorkPerBlock - 1) / kWorkPerBlock, 1, kMaxClusterBlocks));
}

// Threads per block for `work` items per block: 256 up to 512 items, 512 up to 2048, else 1024 (measured
// points in the header comment; plan_sends at T = 128, 1024 pairs: 10.6 µs with 512 threads, 12.1 with 1024).
int BlockThreads(int64_t work) { return work <= 512 ? 256 : work <= 2048 ? 512 : kMaxThreads; }

// What a kernel template's instantiation for `threads` (a BlockThreads value) is or has.
template <typename Value>
Value ForThreads(int threads, Value with256, Value with512, Value with1024) {
  return threads == 256 ? with256 : threads == 512 ? with512 : with1024;
}

}  // namespace

int64_t PlanSendsScratchBytes(const PlanSendsShape& shape) {
  return shape.batch * shape.num_members * shape.num_tokens * static_cast<int64_t>(sizeof(int32_t));
}

cudaError_t LaunchPlanSends(const PlanSendsShape& shape, const int32_t* expert_ids, const float* weights,
                            const PlanSendsResults& results, int32_t* scratch, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const int blocks = ClusterBlocks(shape.num_pairs());
  const int threads = BlockThreads((shape.num_pairs() + blocks - 1) / blocks);
  auto kernel = ForThreads(threads, PlanSendsKernel<256>, PlanSendsKernel<512>, PlanSendsKernel<kMaxThreads>);
  // The dynamic shared memory must leave room for the kernel's static shared memory, its ScanShared alone
  // (1.2 / 2.2 / 4.2 KiB).
  const size_t static_bytes = ForThreads(threads, sizeof(ScanShared<256>), sizeof(ScanShared<512>),
                                         sizeof(ScanShared<kMaxThreads>));
  const int64_t shared_ints = (kSharedBytes - static_cast<int64_t>(static_bytes)) / 4;  // int32s
  // As many sorting warps as shared memory allows, but no more than 32 pairs each fill: every warp costs
  // one __match_any_sync per 32 pairs or fewer, and the SM issues them one warp at a time.
  const int64_t fixed = (shape.num_experts + 2) + (shape.num_members + 1);
  const int64_t fit = (shared_ints - fixed) / (2 * (shape.num_experts + 1));
  const int64_t needed = (shape.num_pairs() + 32 * blocks - 1) / (32 * blocks);
  const int64_t sort_warps = std::clamp<int64_t>(std::min(fit, needed), 1, threads / 32);
  const int64_t sort_ints = 2 * sort_warps * (shape.num_experts + 1) + fixed;
  const int64_t member_tokens = shape.num_members * shape.num_tokens;
  const bool row_of_in_shared = blocks == 1 && sort_ints + member_tokens <= shared_ints;
  const size_t bytes = (sort_ints + (row_of_in_shared ? member_tokens : 0)) * sizeof(int32_t);
  const PlanSendsDivisors by{Divisor(shape.top_k),    Divisor(shape.local_experts()), Divisor(shape.num_tokens),
                             Divisor(shape.capacity), Divisor(shape.suffix_words()),  Divisor(blocks * sort_warps),
                             Divisor(sort_warps)};
  return LaunchClusters(kernel, shape.batch, blocks, threads, bytes, stream, shape, static_cast<int>(sort_warps),
                        row_of_in_shared, by, expert_ids, weights, results, scratch);
}

cudaError_t LaunchPlaceReceived(const PlaceReceivedShape& shape, const uint8_t* received, const int32_t* recv_tokens,
                                const PlaceReceivedResults& results, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const size_t bytes = (4 * shape.num_members * shape.local_experts + shape.num_members) * sizeof(int32_t);
  const int64_t work = shape.num_members * std::max(shape.rows_per_source * shape.top_k, shape.capacity);
  const int blocks = ClusterBlocks(work);
  const int threads = BlockThreads((work + blocks - 1) / blocks);
  auto kernel = ForThreads(threads, PlaceReceivedKernel<256>, PlaceReceivedKernel<512>,
                           PlaceReceivedKernel<kMaxThreads>);
  const PlaceReceivedDivisors by{Divisor(shape.top_k), Divisor(shape.local_experts), Divisor(shape.num_members),
                                 Divisor(shape.rows_per_source * shape.top_k),
                                 Divisor(shape.top_k * shape.local_experts)};
  return LaunchClusters(kernel, shape.batch, blocks, threads, bytes, stream, shape, by, received, recv_tokens, results);
}

}  // namespace jax_ncclx
