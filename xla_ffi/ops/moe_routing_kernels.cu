// Device kernels of the moe routing ops and their launchers. Device code only: the XLA handlers that drive
// them live in moe_routing_cuda.cc. Both kernels run one block of kThreads per batch element; every phase
// of a call ends at a __syncthreads, which also orders the block's global memory writes for the next phase.
#include "ops/moe_routing_kernels.h"

#include <algorithm>
#include <cstdint>

#include <cub/block/block_scan.cuh>

namespace jax_ncclx {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSharedInts = 48 * 1024 / 4;  // dynamic shared memory without an opt-in

using BlockScan = cub::BlockScan<int32_t, kThreads>;

__device__ inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ inline unsigned LanesBelow() {
  unsigned mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// Exclusive prefix sums of value(0), ..., value(n - 1) by the whole block. Each thread takes a contiguous
// run of indices and calls emit(i, sum of the values before i, value(i)) along it, in order. value(i) is
// read twice; emit(i, ...) may overwrite what value(i) reads, nothing else may change in between. Returns
// the total to every thread.
template <typename Value, typename Emit>
__device__ int32_t ScanBlock(int64_t n, Value value, Emit emit, typename BlockScan::TempStorage& storage) {
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const int64_t begin = Min(n, threadIdx.x * per_thread), end = Min(n, begin + per_thread);
  int32_t sum = 0;
  for (int64_t i = begin; i < end; ++i) sum += value(i);
  int32_t running = 0, total = 0;
  BlockScan(storage).ExclusiveSum(sum, running, total);
  for (int64_t i = begin; i < end; ++i) {
    const int32_t v = value(i);
    emit(i, running, v);
    running += v;
  }
  __syncthreads();  // emit's writes are visible, and the storage may be reused
  return total;
}

// The largest j < n with starts[j] <= x, for ascending starts with starts[0] <= x: the block holding x when
// blocks j start at starts[j] (empty blocks share their successor's start).
__device__ inline int32_t BlockAt(const int32_t* starts, int32_t n, int32_t x) {
  int32_t low = 0, high = n - 1;
  while (low < high) {
    const int32_t mid = (low + high + 1) / 2;
    if (starts[mid] <= x) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

// A stable counting sort of the pairs by key: warp w walks the w-th contiguous segment of the pairs 32 at a
// time, and lanes with equal keys find each other with __match_any_sync, so the order within a key is
// segment order, then lane order. Pass 1 counts each key per warp; after a scan over (key, warp), pass 2
// places the pairs. The per-warp counters take sort_warps * (E + 1) ints of shared memory, so fewer warps
// sort when there are many experts.
__global__ void __launch_bounds__(kThreads)
    PlanSendsKernel(PlanSendsShape shape, int sort_warps, const int32_t* __restrict__ expert_ids,
                    PlanSendsResults out, int32_t* __restrict__ scratch) {
  const int32_t E = shape.num_experts, N = shape.num_members, local = shape.local_experts();
  const int32_t C = shape.capacity, T = shape.num_tokens, k = shape.top_k;
  const int32_t P = shape.num_pairs(), S = shape.num_rows(), NT = N * T;
  const int64_t b = blockIdx.x;
  const int32_t* ids = expert_ids + b * P;
  int32_t* order = out.order + b * P;
  int32_t* return_slot = out.return_slot + b * P;
  int32_t* send_token = out.send_token + b * S;
  int32_t* tags = out.send_tags + b * S * k;
  // Per (member, token): first 1 if the token goes to the member, then its send row (or -1).
  int32_t* row_of = scratch + b * NT;

  extern __shared__ int32_t shared[];
  int32_t* counters = shared;                              // [sort_warps][E + 1]
  int32_t* key_start = counters + sort_warps * (E + 1);    // [E + 2] where each key starts in the order
  int32_t* first_row = key_start + E + 2;                  // [N + 1] each member's first send row
  __shared__ typename BlockScan::TempStorage scan_storage;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int32_t i = tid; i < sort_warps * (E + 1); i += kThreads) counters[i] = 0;
  for (int32_t i = tid; i < NT; i += kThreads) row_of[i] = 0;
  for (int32_t i = tid; i < S; i += kThreads) send_token[i] = T;
  for (int32_t i = tid; i < S * k; i += kThreads) tags[i] = -1;
  __syncthreads();

  const int32_t per_warp = (P + sort_warps - 1) / sort_warps;
  const int32_t segment_begin = Min(P, warp * per_warp), segment_end = Min(P, segment_begin + per_warp);
  int32_t* my_counters = counters + warp * (E + 1);
  if (warp < sort_warps) {
    for (int32_t base = segment_begin; base < segment_end; base += 32) {
      const int32_t pair = base + lane;
      const bool live = pair < segment_end;
      const int32_t key = live ? RoutingKey(ids[pair], E) : E + 1 + lane;  // dead lanes match nobody
      const unsigned same = __match_any_sync(0xffffffffu, key);
      if (live && lane == __ffs(same) - 1) my_counters[key] += __popc(same);
    }
  }
  __syncthreads();

  // Keys in order, and within a key the warps in order: each counter becomes where its pairs start.
  const int32_t num_pairs = ScanBlock(
      E + 1,
      [&](int64_t key) {
        int32_t sum = 0;
        for (int w = 0; w < sort_warps; ++w) sum += counters[w * (E + 1) + key];
        return sum;
      },
      [&](int64_t key, int32_t start, int32_t) {
        key_start[key] = start;
        for (int w = 0; w < sort_warps; ++w) {
          const int32_t count = counters[w * (E + 1) + key];
          counters[w * (E + 1) + key] = start;
          start += count;
        }
      },
      scan_storage);
  if (tid == 0) key_start[E + 1] = num_pairs;
  __syncthreads();
  for (int32_t e = tid; e < E; e += kThreads) out.send_counts[b * E + e] = key_start[e + 1] - key_start[e];
  for (int32_t m = tid; m < N; m += kThreads) {
    const int32_t sent = key_start[(m + 1) * local] - key_start[m * local];
    out.dropped[b * N + m] = sent > C ? sent - C : 0;
  }

  if (warp < sort_warps) {
    for (int32_t base = segment_begin; base < segment_end; base += 32) {
      const int32_t pair = base + lane;
      const bool live = pair < segment_end;
      const int32_t key = live ? RoutingKey(ids[pair], E) : E + 1 + lane;
      const unsigned same = __match_any_sync(0xffffffffu, key);
      const int32_t start = live ? my_counters[key] : 0;
      __syncwarp();
      if (live && lane == __ffs(same) - 1) my_counters[key] = start + __popc(same);
      __syncwarp();
      if (!live) continue;
      const int32_t position = start + __popc(same & LanesBelow());
      order[position] = pair;
      int32_t slot = N * C;
      if (key < E) {
        const int32_t member = key / local, offset = position - key_start[member * local];
        if (offset < C) {  // the member takes its first C pairs in the order
          slot = member * C + offset;
          row_of[member * T + pair / k] = 1;
        }
      }
      return_slot[pair] = slot;
    }
  }
  __syncthreads();

  // Send rows: member-major, tokens ascending within a member.
  const int32_t total_rows = ScanBlock(
      NT, [&](int64_t i) { return row_of[i]; },
      [&](int64_t i, int32_t row, int32_t goes) {
        if (i % T == 0) first_row[i / T] = row;
        row_of[i] = goes ? row : -1;
      },
      scan_storage);
  if (tid == 0) first_row[N] = total_rows;
  __syncthreads();

  for (int32_t m = tid; m < N; m += kThreads) out.token_counts[b * N + m] = first_row[m + 1] - first_row[m];
  for (int32_t i = tid; i < NT; i += kThreads) {
    const int32_t row = row_of[i];
    if (row >= 0 && row < S) send_token[row] = i % T;
  }
  // Member m's tag entries, from row first_row[m]: its delivered pairs in the order, each as the row of
  // the token (counted from the member's first row) and the local expert.
  for (int32_t position = tid; position < P; position += kThreads) {
    const int32_t pair = order[position];
    const int32_t key = RoutingKey(ids[pair], E);
    if (key == E) continue;
    const int32_t member = key / local, offset = position - key_start[member * local];
    const int32_t entry = first_row[member] * k + offset;
    if (offset < C && entry < S * k) {
      const int32_t row = row_of[member * T + pair / k] - first_row[member];
      tags[entry] = row * local + key % local;
    }
  }
}

// Counts the valid tags per (source, local expert), scans the counts in source-major and expert-major order,
// and walks the N * C expert-major rows, each finding its block by binary search.
__global__ void __launch_bounds__(kThreads)
    PlaceReceivedKernel(PlaceReceivedShape shape, const int32_t* __restrict__ all_tags,
                        const int32_t* __restrict__ all_recv_tokens, PlaceReceivedResults out) {
  const int32_t N = shape.num_members, R = shape.rows_per_source, k = shape.top_k;
  const int32_t local = shape.local_experts, C = shape.capacity;
  const int32_t blocks = N * local, per_source = R * k, rows = N * C;
  const int64_t b = blockIdx.x;
  const int32_t* tags = all_tags + b * N * per_source;
  const int32_t* recv_tokens = all_recv_tokens + b * N;

  extern __shared__ int32_t shared[];
  int32_t* counts = shared;                       // [N][E_local]
  int32_t* source_major = counts + blocks;        // [N][E_local] where block (i, e) starts, source-major
  int32_t* expert_major = source_major + blocks;  // [E_local][N] where block (e, i) starts, expert-major
  __shared__ typename BlockScan::TempStorage scan_storage;

  const int tid = threadIdx.x;
  for (int32_t i = tid; i < blocks; i += kThreads) counts[i] = 0;
  __syncthreads();
  for (int32_t entry = tid; entry < N * per_source; entry += kThreads) {
    const int32_t source = entry / per_source;
    const int32_t tag = tags[entry];
    if ((entry % per_source) / k < recv_tokens[source] && tag >= 0) atomicAdd(&counts[source * local + tag % local], 1);
  }
  __syncthreads();

  ScanBlock(
      blocks, [&](int64_t i) { return counts[i]; },
      [&](int64_t i, int32_t start, int32_t) { source_major[i] = start; }, scan_storage);
  const int32_t total = ScanBlock(
      blocks, [&](int64_t j) { return counts[(j % N) * local + j / N]; },
      [&](int64_t j, int32_t start, int32_t) { expert_major[j] = start; }, scan_storage);

  for (int32_t i = tid; i < blocks; i += kThreads) out.recv_counts[b * blocks + i] = counts[i];
  for (int32_t e = tid; e < local; e += kThreads) {
    int32_t sum = 0;
    for (int32_t source = 0; source < N; ++source) sum += counts[source * local + e];
    out.group_sizes[b * local + e] = sum;
  }
  for (int32_t x = tid; x < rows; x += kThreads) {
    int32_t expand = N * R, to_expert_major = rows, to_source_major = rows;
    if (x < total) {
      const int32_t j = BlockAt(expert_major, blocks, x);
      const int32_t e = j / N, source = j % N;
      // Source i's tags list its pairs sorted by expert: expert e's start after its earlier experts'.
      const int32_t in_list = source_major[source * local + e] - source_major[source * local] + x - expert_major[j];
      if (in_list < C) to_expert_major = source * C + in_list;
      const int32_t tag = tags[source * per_source + in_list];
      if (tag >= 0 && tag / local < R) expand = source * R + tag / local;
      const int32_t i = BlockAt(source_major, blocks, x);
      to_source_major = min(expert_major[(i % local) * N + i / local] + x - source_major[i], rows);
    }
    out.expand_rows[b * rows + x] = expand;
    out.to_expert_major[b * rows + x] = to_expert_major;
    out.to_source_major[b * rows + x] = to_source_major;
  }
}

}  // namespace

int64_t PlanSendsScratchBytes(const PlanSendsShape& shape) {
  return shape.batch * shape.num_members * shape.num_tokens * static_cast<int64_t>(sizeof(int32_t));
}

cudaError_t LaunchPlanSends(const PlanSendsShape& shape, const int32_t* expert_ids, const PlanSendsResults& results,
                            int32_t* scratch, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const int64_t fixed = (shape.num_experts + 2) + (shape.num_members + 1);
  const int64_t sort_warps =
      std::clamp<int64_t>((kSharedInts - fixed) / (shape.num_experts + 1), 1, kWarps);
  const size_t bytes = (sort_warps * (shape.num_experts + 1) + fixed) * sizeof(int32_t);
  PlanSendsKernel<<<shape.batch, kThreads, bytes, stream>>>(shape, static_cast<int>(sort_warps), expert_ids,
                                                            results, scratch);
  return cudaGetLastError();
}

cudaError_t LaunchPlaceReceived(const PlaceReceivedShape& shape, const int32_t* tags, const int32_t* recv_tokens,
                                const PlaceReceivedResults& results, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const size_t bytes = 3 * shape.num_members * shape.local_experts * sizeof(int32_t);
  PlaceReceivedKernel<<<shape.batch, kThreads, bytes, stream>>>(shape, tags, recv_tokens, results);
  return cudaGetLastError();
}

}  // namespace jax_ncclx
