// The NVLink kernel of moe.dispatch (see moe_dispatch.h for the algorithm and the slots).
//
// Phases of every block: plan (shared memory, the same in every block), send (a share of the rows, then one
// flag per member), wait (every member's every block), place (shared memory again, the same in every block)
// and expand (a share of the expert-major rows). Each block writes its share of every result array; the
// plan's and placement's values are the same in every block, so the shares agree.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "common/device_sync.cuh"
#include "common/symmetric_layout.h"
#include "ops/collectives/nvlink_collectives_kernels.h"
#include "ops/moe/moe_device.cuh"
#include "ops/moe/moe_dispatch.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kHeaderBytes = 256;  // a 16-byte token count per source, ahead of the rows
static_assert(16 * kMaxNvlinkRanks <= kHeaderBytes);
static_assert(kMaxMoeDispatchBlocks <= kMaxFlagGroups);

using BlockScan = cub::BlockScan<int32_t, kThreads>;

// Exclusive prefix sums of value(0), ..., value(n - 1) over the block: each thread takes a contiguous run and
// calls emit(i, sum before i, value(i)) along it. value(i) is read twice; emit(i, ...) may overwrite what
// value(i) reads. Returns the total to every thread.
template <typename Value, typename Emit>
__device__ int32_t ScanBlock(int32_t n, Value value, Emit emit, BlockScan::TempStorage& storage) {
  const int32_t per_thread = (n + kThreads - 1) / kThreads;
  const int32_t begin = min(n, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(n, begin + per_thread);
  int32_t sum = 0;
  for (int32_t i = begin; i < end; ++i) sum += value(i);
  int32_t running = 0, total = 0;
  BlockScan(storage).ExclusiveSum(sum, running, total);
  for (int32_t i = begin; i < end; ++i) {
    const int32_t v = value(i);
    emit(i, running, v);
    running += v;
  }
  __syncthreads();  // emit's writes are visible, and the storage may be used again
  return total;
}

struct Call {
  MoeDispatchArgs args;
  int64_t slot_base;  // where the header starts in a parity half: past the LL areas
  int64_t slot_row;   // bytes of a slot row
};

__device__ __forceinline__ uint8_t* Slots(const Call& call, int owner, int parity) {
  const PeerTable* table = call.args.table;
  return table->data[owner] + parity * table->parity_half_bytes + call.slot_base;
}

// The plan's shared memory (ints): what the send and the tags need.
struct Plan {
  int16_t* key;         // [P] each pair's routing key (RoutingKey)
  int32_t* sorted;      // [P] the pairs sorted stably by key (the result `order`)
  int32_t* next;        // [E + 1] per key: the counts, then the next free place in `sorted`
  int32_t* key_start;   // [E + 2] where each key starts in `sorted`
  int32_t* row_of;      // [N * T] (member, token): its send row, or -1
  int32_t* first_row;   // [N + 1] each member's first send row
  int32_t* send_token;  // [S] the token of each send row
};

__device__ Plan LayOutPlan(int32_t* shared, int32_t P, int32_t E, int32_t N, int32_t T) {
  Plan plan;
  plan.sorted = shared;
  plan.next = plan.sorted + P;
  plan.key_start = plan.next + (E + 1);
  plan.row_of = plan.key_start + (E + 2);
  plan.first_row = plan.row_of + N * T;
  plan.send_token = plan.first_row + (N + 1);
  plan.key = reinterpret_cast<int16_t*>(plan.send_token + N * T);
  return plan;
}

// The placement's shared memory, over the plan's (which is done with by then).
struct Placement {
  int32_t* counts;        // [N][E_local] valid tags per (source, local expert)
  int32_t* source_major;  // [N][E_local] where block (i, e) starts, source-major
  int32_t* expert_major;  // [E_local][N] total + where block (e, i) starts, expert-major
  int32_t* packed_start;  // [N] 2 * total + where source i's received rows start, packed
  int32_t* delivered;     // [N] token rows each source delivered, clamped to [0, R]
};

__device__ Placement LayOutPlacement(int32_t* shared, int32_t N, int32_t L) {
  Placement placed;
  placed.counts = shared;
  placed.source_major = placed.counts + N * L;
  placed.expert_major = placed.source_major + N * L;
  placed.packed_start = placed.expert_major + N * L;
  placed.delivered = placed.packed_start + N;
  return placed;
}

__global__ void __launch_bounds__(kThreads) MoeDispatchKernel(Call call) {
  const MoeDispatchArgs& args = call.args;
  const uint64_t epoch = CallEpoch(args.control);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeDispatch, args.site,
                      args.timeout_ns);
  if (threadIdx.x == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  const int32_t N = args.size, me = args.rank, k = args.top_k;
  const int32_t T = static_cast<int32_t>(args.tokens), E = static_cast<int32_t>(args.num_experts);
  const int32_t L = E / N, C = static_cast<int32_t>(min(args.capacity, int64_t{1} << 30));
  const int32_t P = T * k, R = min(C, T);
  const PlanSendsShape shape = args.plan_shape();
  const int32_t S = static_cast<int32_t>(shape.num_rows());
  const int32_t words = static_cast<int32_t>(shape.suffix_words()), padded = static_cast<int32_t>(PaddedWords(k));
  const int32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int32_t thread = blockIdx.x * kThreads + tid, threads = gridDim.x * kThreads;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  const int64_t first_unit = int64_t{blockIdx.x} * kWarps + warp;
  const int64_t row_vectors = args.row_bytes / 16, slot_vectors = call.slot_row / 16;
  extern __shared__ int32_t shared[];
  __shared__ BlockScan::TempStorage scan;

  // ---- plan: plan_sends' arithmetic for this member, in shared memory ----
  const Plan plan = LayOutPlan(shared, P, E, N, T);
  for (int32_t i = tid; i <= E; i += kThreads) plan.next[i] = 0;
  for (int32_t i = tid; i < N * T; i += kThreads) plan.row_of[i] = 0;
  for (int32_t i = tid; i < S; i += kThreads) plan.send_token[i] = T;
  __syncthreads();
  for (int32_t p = tid; p < P; p += kThreads) {
    const int32_t key = RoutingKey(args.expert_ids[p], E);
    plan.key[p] = static_cast<int16_t>(key);
    atomicAdd(&plan.next[key], 1);
  }
  __syncthreads();
  ScanBlock(
      E + 1, [&](int32_t e) { return plan.next[e]; },
      [&](int32_t e, int32_t start, int32_t) {
        plan.key_start[e] = start;
        plan.next[e] = start;
      },
      scan);
  if (tid == 0) plan.key_start[E + 1] = P;
  // A stable counting sort by one warp, 32 pairs at a time: lanes with equal keys find each other with
  // __match_any_sync and take consecutive places in pair order. Decode sizes have few chunks.
  if (warp == 0) {
    for (int32_t base = 0; base < P; base += 32) {
      const int32_t p = base + lane;
      const bool live = p < P;
      const int32_t key = live ? plan.key[p] : E + 1 + lane;
      const unsigned same = __match_any_sync(0xffffffffu, key);
      const int32_t start = live ? plan.next[key] : 0;
      __syncwarp();
      if (live && lane == __ffs(same) - 1) plan.next[key] = start + __popc(same);
      __syncwarp();
      if (live) plan.sorted[start + __popc(same & LanesBelow())] = p;
    }
  }
  __syncthreads();
  // Which pairs each member takes (its first C in the order), and the tokens that go to it.
  for (int32_t position = tid; position < P; position += kThreads) {
    const int32_t pair = plan.sorted[position], key = plan.key[pair];
    if (key < E) {
      const int32_t member = key / L;
      if (position - plan.key_start[member * L] < C) plan.row_of[member * T + pair / k] = 1;
    }
  }
  __syncthreads();
  ScanBlock(
      N * T, [&](int32_t i) { return plan.row_of[i]; },
      [&](int32_t i, int32_t row, int32_t goes) {
        if (i % T == 0) plan.first_row[i / T] = row;
        if (i == N * T - 1) plan.first_row[N] = row + goes;
        plan.row_of[i] = goes ? row : -1;
        if (goes) plan.send_token[row] = i % T;
      },
      scan);
  if (N * T == 0 && tid <= N) plan.first_row[tid] = 0;
  __syncthreads();

  // The plan's results, each block its share.
  const PlanSendsResults& out = args.plan;
  for (int32_t position = thread; position < P; position += threads) {
    const int32_t pair = plan.sorted[position], key = plan.key[pair];
    int32_t slot = N * C;
    if (key < E) {
      const int32_t member = key / L, offset = position - plan.key_start[member * L];
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
    const int32_t member = i / T, token = i % T, row = plan.row_of[i];
    out.return_row[token * N + member] = row >= 0 ? member * R + row - plan.first_row[member] : N * R;
  }
  // row_pairs' "no pair" entries before the flags: a block places its rows' entries after every block's flag.
  for (int32_t i = thread; i < N * R * k; i += threads) args.placed.row_pairs[i] = N * C;

  if (tid == 0) trace.Ready();

  // ---- send: each send row's token bytes, then its suffix, to row me * R + r of its member's slots ----
  // Tag `entry` of member m's list (the entry-th of its delivered pairs, or -1).
  auto tag_of = [&](int32_t m, int32_t entry) {
    const int32_t begin = plan.key_start[m * L];
    const int32_t delivered = min(C, plan.key_start[(m + 1) * L] - begin);
    if (entry >= delivered) return -1;
    const int32_t pair = plan.sorted[begin + entry], token = pair / k;
    const int32_t row = plan.row_of[m * T + token] - plan.first_row[m];
    return (row * k + pair - token * k) * L + plan.key[pair] % L;
  };
  const int32_t sent_rows = plan.first_row[N];
  const uint4* tokens = static_cast<const uint4*>(args.tokens_in);
  const Units send(sent_rows, slot_vectors, warps);
  for (int64_t unit = first_unit; unit < int64_t{sent_rows} * send.pieces; unit += warps) {
    const int32_t g = static_cast<int32_t>(unit / send.pieces);
    const int64_t lo = (unit - int64_t{g} * send.pieces) * send.piece_len;
    const int64_t hi = min(slot_vectors, lo + send.piece_len);
    int32_t m = 0;
    while (m + 1 < N && plan.first_row[m + 1] <= g) ++m;
    const int32_t r = g - plan.first_row[m], token = plan.send_token[g];
    uint4* to = reinterpret_cast<uint4*>(Slots(call, m, parity) + kHeaderBytes + (int64_t{me} * R + r) * call.slot_row);
    for (int64_t v = lo + lane; v < hi; v += 32) {
      if (v < row_vectors) {
        to[v] = tokens[int64_t{token} * row_vectors + v];
        continue;
      }
      int32_t word[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int32_t w = static_cast<int32_t>(v - row_vectors) * 4 + u;
        if (w < padded) {
          word[u] = w < k ? tag_of(m, r * k + w) : -1;
        } else {
          word[u] = w - padded < k ? __float_as_int(args.weights[token * k + w - padded]) : 0;
        }
      }
      to[v] = make_uint4(word[0], word[1], word[2], word[3]);
    }
  }
  if (blockIdx.x == 0 && tid < N) {  // this member's token count, in member tid's header
    *reinterpret_cast<int32_t*>(Slots(call, tid, parity) + 16 * me) = plan.first_row[tid + 1] - plan.first_row[tid];
  }
  __syncthreads();  // every thread's writes come before the releases
  if (tid < N) StoreRelease(&args.table->control[tid]->arrived[me][blockIdx.x], epoch);
  if (tid == 0) trace.Sent();

  // ---- wait: every member's every block has written its rows here ----
  const int grid = static_cast<int>(gridDim.x);
  bool came = true;
  for (int flag = tid; came && flag < N * grid; flag += kThreads) {
    const int member = flag / grid;
    came = patience.AtLeast(&args.control->arrived[member][flag % grid], epoch, member);
  }
  __syncthreads_or(!came);  // a wait that gave up leaves stale rows, never a hang
  if (tid == 0) trace.DataArrived();

  // ---- place: place_received's arithmetic over the tags in this member's slots ----
  const uint8_t* mine = Slots(call, me, parity);
  const uint8_t* rows = mine + kHeaderBytes;
  const int32_t per_source = R * k, entries = N * per_source, blocks = N * L, NC = N * C;
  auto tag_at = [&](int32_t entry) {  // entry i of the tags read as one list: tag i % k of received row i / k
    return __ldcg(reinterpret_cast<const int32_t*>(rows + int64_t{entry / k} * call.slot_row + args.row_bytes) +
                  entry % k);
  };
  const Placement placed = LayOutPlacement(shared, N, L);
  for (int32_t i = tid; i < blocks; i += kThreads) placed.counts[i] = 0;
  for (int32_t s = tid; s < N; s += kThreads) {
    const int32_t got = __ldcg(reinterpret_cast<const int32_t*>(mine + 16 * s));
    placed.delivered[s] = min(max(got, 0), R);
    if (blockIdx.x == 0) args.recv_tokens[s] = got;
  }
  __syncthreads();
  for (int32_t entry = tid; entry < entries; entry += kThreads) {
    const int32_t source = entry / per_source, tag = tag_at(entry);
    if ((entry - source * per_source) / k < placed.delivered[source] && tag >= 0) {
      atomicAdd(&placed.counts[source * L + tag % L], 1);
    }
  }
  if (args.with_weights) {  // rows past a source's data hold another call's bytes: their weights are zeros
    for (int32_t entry = thread; entry < entries; entry += threads) {
      const int32_t source = entry / per_source, row = entry / k;
      const float weight = __ldcg(reinterpret_cast<const float*>(rows + int64_t{row} * call.slot_row + args.row_bytes) +
                                  padded + entry % k);
      args.placed.recv_weights[entry] = (row - source * R) < placed.delivered[source] ? weight : 0.0f;
    }
  }
  __syncthreads();
  const int32_t scanned = ScanBlock(
      2 * blocks + N,
      [&](int32_t i) {
        if (i < blocks) return placed.counts[i];
        if (i < 2 * blocks) return placed.counts[(i - blocks) % N * L + (i - blocks) / N];
        return placed.delivered[i - 2 * blocks];
      },
      [&](int32_t i, int32_t start, int32_t) { placed.source_major[i] = start; }, scan);
  const int32_t total = placed.expert_major[0], delivered = scanned - 2 * total;
  for (int32_t i = thread; i < blocks; i += threads) args.placed.recv_counts[i] = placed.counts[i];
  for (int32_t e = thread; e < L; e += threads) {
    int32_t sum = 0;
    for (int32_t source = 0; source < N; ++source) sum += placed.counts[source * L + e];
    args.placed.group_sizes[e] = sum;
  }
  // Expert-major row x: its source, its entry in the source's list and the received row behind it.
  struct Row {
    int32_t source, in_list, expand;
  };
  auto row_at = [&](int32_t x) {
    Row row{0, 0, N * R};
    if (x >= total) return row;
    const int32_t j = BlockAt(placed.expert_major, blocks, x + total);
    const int32_t e = j / N;
    row.source = j % N;
    row.in_list = placed.source_major[row.source * L + e] - placed.source_major[row.source * L] + x + total -
                  placed.expert_major[j];
    return row;
  };
  for (int32_t x = thread; x < NC; x += threads) {
    int32_t expand = N * R, entry = entries, expert_row = NC, source_row = NC;
    if (x < total) {
      const Row row = row_at(x);
      if (row.in_list < C) expert_row = row.source * C + row.in_list;
      const int32_t tag = tag_at(row.source * per_source + row.in_list);  // (row * k + choice) * E_local + expert
      if (tag >= 0 && tag / (k * L) < R) {
        expand = row.source * R + tag / (k * L);
        entry = expand * k + tag / L % k;
        args.placed.row_pairs[entry] = x;
      }
      const int32_t i = BlockAt(placed.source_major, blocks, x);
      source_row = min(placed.expert_major[i % L * N + i / L] - total + x - placed.source_major[i], NC);
    }
    args.placed.expand_rows[x] = expand;
    args.placed.pair_entry[x] = entry;
    args.placed.to_expert_major[x] = expert_row;
    args.placed.to_source_major[x] = source_row;
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
  const Units expand(NC, row_vectors, warps);
  for (int64_t unit = first_unit; unit < int64_t{NC} * expand.pieces; unit += warps) {
    const int32_t x = static_cast<int32_t>(unit / expand.pieces);
    const int64_t lo = (unit - int64_t{x} * expand.pieces) * expand.piece_len;
    const int64_t hi = min(row_vectors, lo + expand.piece_len);
    const uint4* from = nullptr;
    if (x < total) {
      const Row row = row_at(x);
      const int32_t tag = tag_at(row.source * per_source + row.in_list);
      if (tag >= 0 && tag / (k * L) < R) {
        from = reinterpret_cast<const uint4*>(rows + (int64_t{row.source} * R + tag / (k * L)) * call.slot_row);
      }
    }
    uint4* to = expert_rows + int64_t{x} * row_vectors;
    for (int64_t v = lo + lane; v < hi; v += 32) to[v] = from != nullptr ? __ldcg(from + v) : make_uint4(0, 0, 0, 0);
  }
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeDispatch);
}

// Shared memory of a call's plan and placement (they share it), in bytes.
size_t SharedBytes(const MoeDispatchArgs& args) {
  const int64_t P = args.tokens * args.top_k, E = args.num_experts, N = args.size, T = args.tokens;
  const int64_t plan_ints = P + (E + 1) + (E + 2) + N * T + (N + 1) + N * T;
  const int64_t plan_bytes = plan_ints * 4 + P * 2;
  const int64_t place_bytes = (3 * E + 2 * N) * 4;
  return static_cast<size_t>((std::max(plan_bytes, place_bytes) + 15) / 16 * 16);
}

}  // namespace

int64_t MoeDispatchSlotRowBytes(int top_k, int64_t row_bytes, bool with_weights) {
  return row_bytes + SuffixWords(top_k, with_weights) * 4;
}

int64_t MoeDispatchSlotBytes(int size, int64_t rows_per_member, int top_k, int64_t row_bytes, bool with_weights) {
  const int64_t bytes = NvlinkLowLatencyAreaBytes(size) + kHeaderBytes +
                        size * rows_per_member * MoeDispatchSlotRowBytes(top_k, row_bytes, with_weights);
  return (bytes + 255) / 256 * 256;
}

int ChooseMoeDispatchBlocks(const MoeDispatchArgs& args, int requested, int sm_count) {
  // A thread per 16-byte vector of the larger side (the expert-major rows written, or the rows sent), up to a
  // block per SM (every block waits for every other, so all must be resident at once) and the flags.
  const int64_t R = std::min(args.capacity, args.tokens);
  const int64_t rows = std::max(args.size * args.capacity, args.size * R);
  const int64_t items = rows * (MoeDispatchSlotRowBytes(args.top_k, args.row_bytes, args.with_weights) / 16);
  const int64_t by_size = (items + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeDispatchBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

cudaError_t LaunchMoeDispatch(const MoeDispatchArgs& args, int blocks, cudaStream_t stream) {
  const Call call{args, NvlinkLowLatencyAreaBytes(args.size),
                  MoeDispatchSlotRowBytes(args.top_k, args.row_bytes, args.with_weights)};
  MoeDispatchKernel<<<blocks, kThreads, SharedBytes(args), stream>>>(call);
  return cudaGetLastError();
}

}  // namespace jax_ncclx
