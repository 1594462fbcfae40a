// The NVLink kernel of moe.combine (see moe_combine.h for the algorithm and the slots).
//
// Every block does both halves, over (row, 16-byte vector) items shared out among all the grid's threads: on
// the expert side each received row's sum over its k choices (in float32, rounded once, as the exchange chain
// sends it), then one flag per member; on the token side, once every (member, block) flag holds the epoch,
// each token's members' rows added in float32 in member order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/device_sync.cuh"
#include "common/symmetric_layout.h"
#include "ops/moe/moe_combine.h"
#include "ops/moe/moe_device.cuh"
#include "ops/collectives/nvlink_collectives_kernels.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
// Choices loaded together on the expert side; vectors per lane loaded together on the token side.
constexpr int kChunk = 8;
constexpr int kTokenVectors = 2;
static_assert(kMaxMoeCombineBlocks <= kMaxFlagGroups);

struct Call {
  MoeCombineArgs args;
  int64_t slot_base;  // where the slots start in a parity half: past the LL areas
};

// Row `row` of `owner`'s slots for calls of `parity`.
__device__ __forceinline__ uint4* SlotRow(const Call& call, int owner, int parity, int64_t row, int64_t row_vectors) {
  return reinterpret_cast<uint4*>(Slots(call.args.table, call.slot_base, owner, parity)) + row * row_vectors;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) MoeCombineKernel(Call call) {
  using V = Lanes<T>;
  const MoeCombineArgs& args = call.args;
  const uint64_t epoch = CallEpoch(args.control);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeCombine, args.site,
                      args.timeout_ns);
  if (threadIdx.x == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  const int n = args.size;
  const int me = args.rank;
  const int k = args.top_k;
  const int64_t R = args.rows_per_member;
  const int64_t vectors = args.hidden / V::kCount;  // per row
  const uint4* expert_out = static_cast<const uint4*>(args.expert_out);
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  const int64_t first_unit = int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32;
  // Per warp: the current row's k pair indices, then their weights (as bits), read once per unit.
  extern __shared__ int32_t shared[];
  int32_t* row_pairs = shared + (threadIdx.x / 32) * 2 * k;
  float* row_weights = reinterpret_cast<float*>(row_pairs + k);

  // Expert side: received row i = s * R + r is source s's r-th token row; its sum goes to row me * R + r of
  // s's slots. kChunk choices are loaded before any is added, so their latencies overlap.
  const Units expert(n * R, vectors, warps);
  for (int64_t unit = first_unit; unit < expert.count(); unit += warps) {
    const auto [i, lo, hi] = expert.At(unit);
    const int s = static_cast<int>(i / R);
    const int64_t r = i - s * R;
    const int32_t delivered = args.recv_tokens[s];  // loaded with the indices: one round trip, not two
    for (int j = lane; j < k; j += 32) {
      row_pairs[j] = args.row_pairs[i * k + j];
      row_weights[j] = args.weights[i * k + j];
    }
    __syncwarp();
    if (r >= delivered) continue;  // the same on every lane
    uint4* to = SlotRow(call, s, parity, me * R + r, vectors);
    for (int64_t v = lo + lane; v < hi; v += 32) {
      float acc[V::kCount] = {};
      for (int j0 = 0; j0 < k; j0 += kChunk) {
        uint4 rows[kChunk];
        float w[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const int j = j0 + u;
          const int64_t pair = j < k ? row_pairs[j] : args.expert_rows;
          const bool here = pair < args.expert_rows;
          w[u] = here ? row_weights[j] : 0.0f;
          rows[u] = here ? expert_out[pair * vectors + v] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kChunk; ++u) V::Add(acc, rows[u], w[u]);
      }
      to[v] = V::FromFloat(acc);
    }
    __syncwarp();  // the indices stay until every lane is done with them
  }
  __syncthreads();  // every thread's writes come before the releases
  if (threadIdx.x < n) {
    StoreRelease(&args.table->control[threadIdx.x]->arrived[me][blockIdx.x], epoch);
  }
  if (threadIdx.x == 0) trace.Sent();

  // Token side. Its first unit's rows are looked up before the wait: return_row is an input, not peer data.
  uint4* out = static_cast<uint4*>(args.out);
  const Units token(args.tokens, vectors, warps);
  int32_t first_rows[kMaxNvlinkRanks];
#pragma unroll
  for (int m = 0; m < kMaxNvlinkRanks; ++m) {
    first_rows[m] = m < n && first_unit < token.count() ? args.return_row[token.At(first_unit).row * n + m]
                                                        : static_cast<int32_t>(n * R);
  }
  // Every member's every block has written its rows here.
  WaitForEveryBlock<kThreads>(patience, args.control, n, epoch);
  if (threadIdx.x == 0) trace.DataArrived();

  // Each lane adds kTokenVectors vectors of every member at once: with few members one row per token is
  // all there is to read, and its latency would otherwise be paid vector by vector.
  for (int64_t unit = first_unit; unit < token.count(); unit += warps) {
    const auto [t, lo, hi] = token.At(unit);
    const uint4* from[kMaxNvlinkRanks];
#pragma unroll
    for (int m = 0; m < kMaxNvlinkRanks; ++m) {
      const int64_t row = unit == first_unit ? first_rows[m] : m < n ? args.return_row[t * n + m] : n * R;
      from[m] = row < n * R ? SlotRow(call, me, parity, row, vectors) : nullptr;
    }
    for (int64_t v0 = lo + lane; v0 < hi; v0 += 32 * kTokenVectors) {
      float acc[kTokenVectors][V::kCount] = {};
#pragma unroll
      for (int m = 0; m < kMaxNvlinkRanks; ++m) {
        uint4 rows[kTokenVectors];
#pragma unroll
        for (int u = 0; u < kTokenVectors; ++u) {
          const int64_t v = v0 + u * 32;
          rows[u] = from[m] != nullptr && v < hi ? __ldcg(from[m] + v) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kTokenVectors; ++u) V::Add(acc[u], rows[u], 1.0f);
      }
#pragma unroll
      for (int u = 0; u < kTokenVectors; ++u) {
        if (v0 + u * 32 < hi) out[t * vectors + v0 + u * 32] = V::FromFloat(acc[u]);
      }
    }
  }
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeCombine);
}

}  // namespace

size_t MoeCombineSharedBytes(int top_k) { return size_t{kThreads / 32} * 2 * top_k * sizeof(int32_t); }

int64_t MoeCombineSlotBytes(int size, int64_t rows_per_member, int64_t hidden, int element_bytes) {
  const int64_t bytes = NvlinkLowLatencyAreaBytes(size) + size * rows_per_member * hidden * element_bytes;
  return (bytes + 255) / 256 * 256;
}

int ChooseMoeCombineBlocks(const MoeCombineArgs& args, int requested, int sm_count) {
  // A thread per 16-byte vector of the larger side, up to a block per SM (every block waits for every other,
  // so all must be resident at once) and the flags.
  const int64_t vectors = args.hidden * FloatTypeBytes(args.type) / 16;  // per row
  const int64_t items = std::max(args.size * args.rows_per_member, args.tokens) * vectors;
  const int64_t by_size = (items + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeCombineBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

cudaError_t LaunchMoeCombine(const MoeCombineArgs& args, int blocks, cudaStream_t stream) {
  const Call call{args, NvlinkLowLatencyAreaBytes(args.size)};
  const size_t shared = MoeCombineSharedBytes(args.top_k);
  switch (args.type) {
    case FloatType::kF32:
      MoeCombineKernel<float><<<blocks, kThreads, shared, stream>>>(call);
      break;
    case FloatType::kBF16:
      MoeCombineKernel<__nv_bfloat16><<<blocks, kThreads, shared, stream>>>(call);
      break;
    case FloatType::kF16:
      MoeCombineKernel<__half><<<blocks, kThreads, shared, stream>>>(call);
      break;
  }
  return cudaGetLastError();
}

}  // namespace jax_ncclx
