// The NVLink kernel of moe.combine (see moe_combine.h for the algorithm and the slots).
//
// Every block does both halves, over (row, piece) units shared out among all the grid's warps: on the expert
// side each received row's sum over its k choices (in float32, rounded once, as the exchange chain sends it);
// on the token side each token's members' rows added in float32 in member order. Two ways to signal:
//   * lines (calls whose slot rows fit kMoeLinesMaxBytes): the sums travel as LL128 lines and the token
//     side polls the lines it reads, so no block waits for the whole grid of every member;
//   * flags (larger calls, where the lines' extra 1/15 of bytes costs more than the wait): 16-byte vectors,
//     then one flag per (member, block), and the token side starts once every flag holds the epoch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/device_sync.cuh"
#include "common/ll128_lines.cuh"
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

// Row `row` of `owner`'s slots for calls of `parity`, rows of `row_units` units of type U (16-byte vectors, or
// the 16-byte parts of a row's lines).
template <typename U>
__device__ __forceinline__ U* SlotRow(const Call& call, int owner, int parity, int64_t row, int64_t row_units) {
  return reinterpret_cast<U*>(Slots(call.args.table, call.slot_base, owner, parity)) + row * row_units;
}

template <typename T, bool kLines>
__global__ void __launch_bounds__(kThreads) MoeCombineKernel(Call call) {
  using V = Lanes<T>;
  const MoeCombineArgs& args = call.args;
  const uint64_t epoch = CallEpoch(args.control);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  CallTrace trace(args.control, epoch, args.trace);
  Patience<> patience(args.table, args.control, args.rank, args.size, epoch, kTraceMoeCombine, args.site,
                      args.timeout_ns);
  const int n = args.size;
  const int me = args.rank;
  const int k = args.top_k;
  if (threadIdx.x == 0) {
    trace.Start();
    trace.PeersEntered();  // nothing to wait for before writing: the slots of this parity are free
  }
  // Lines: a token side reads only the members it has rows from, so each rank also tells every member that it
  // entered the call, and the call ends once every member has entered it (see the end).
  if (kLines && blockIdx.x == 0 && threadIdx.x < n) StoreRelaxed(&args.table->control[threadIdx.x]->entered[me], epoch);
  const int64_t R = args.rows_per_member;
  const int64_t vectors = args.hidden / V::kCount;  // per row
  const int64_t words = args.hidden * int64_t{sizeof(T)} / 4;
  const int64_t steps = LineStepsOf(words * 4);  // per row, with lines
  const int64_t row_parts = steps * kLinesPerWarpStep * kLanesPerLine;
  const int64_t row_units = kLines ? steps : vectors;  // what a piece of a row counts
  const uint4* expert_out = static_cast<const uint4*>(args.expert_out);
  const uint32_t* expert_words = static_cast<const uint32_t*>(args.expert_out);
  const int lane = threadIdx.x % 32;
  const int part = lane % kLanesPerLine;  // with lines: this lane's part of line lane / kLanesPerLine of a step
  const bool flag_lane = part == kLanesPerLine - 1;
  const uint64_t flag = ScrambledLineFlag(epoch);
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  const int64_t first_unit = int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32;
  // Per warp: the current row's k pair indices, then their weights (as bits), read once per unit.
  extern __shared__ int32_t shared[];
  int32_t* row_pairs = shared + (threadIdx.x / 32) * 2 * k;
  float* row_weights = reinterpret_cast<float*>(row_pairs + k);
  // The row's weighted sum of the 16-byte vectors load(pair) returns, kChunk choices loaded before any is
  // added, so that their latencies overlap.
  auto sum_choices = [&](auto load) {
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
        rows[u] = here ? load(pair) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) V::Add(acc, rows[u], w[u]);
    }
    return V::FromFloat(acc);
  };

  // Expert side: received row i = s * R + r is source s's r-th token row; its sum goes to row me * R + r of
  // s's slots.
  const Units expert(n * R, row_units, warps, kLines ? 1 : 32);
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
    if constexpr (kLines) {
      Pair64* to = SlotRow<Pair64>(call, s, parity, me * R + r, row_parts);
      for (int64_t step = lo; step < hi; ++step) {
        const int64_t line = step * kLinesPerWarpStep + lane / kLanesPerLine;
        const LinePart at(line, part, words);
        const uint4 sum = sum_choices([&](int64_t pair) { return LoadPayload(expert_words + pair * words, at); });
        __syncwarp();  // a line's 8 lanes store it in one instruction
        StoreVolatile(to + line * kLanesPerLine + part, PartOf(sum, flag_lane, flag));
      }
    } else {
      uint4* to = SlotRow<uint4>(call, s, parity, me * R + r, vectors);
      for (int64_t v = lo + lane; v < hi; v += 32) {
        to[v] = sum_choices([&](int64_t pair) { return expert_out[pair * vectors + v]; });
      }
    }
    __syncwarp();  // the indices stay until every lane is done with them
  }
  if constexpr (!kLines) {
    __syncthreads();  // every thread's writes come before the releases
    if (threadIdx.x < n) StoreRelease(&args.table->control[threadIdx.x]->arrived[me][blockIdx.x], epoch);
  } else if (args.trace) {
    __syncthreads();
  }
  if (threadIdx.x == 0) trace.Sent();

  // Token side. Its first unit's rows are looked up before any wait: return_row is an input, not peer data.
  const Units token(args.tokens, row_units, warps, kLines ? 1 : 32);
  int32_t first_rows[kMaxNvlinkRanks];
#pragma unroll
  for (int m = 0; m < kMaxNvlinkRanks; ++m) {
    first_rows[m] = m < n && first_unit < token.count() ? args.return_row[token.At(first_unit).row * n + m]
                                                        : static_cast<int32_t>(n * R);
  }
  auto member_row = [&](int64_t unit, int64_t t, int m) {
    return unit == first_unit ? first_rows[m] : m < n ? args.return_row[t * n + m] : n * R;
  };
  if constexpr (kLines) {
    uint32_t* out = static_cast<uint32_t*>(args.out);
    bool live = true;  // false once a wait gave up: the rest of the call reads what is there
    for (int64_t unit = first_unit; unit < token.count(); unit += warps) {
      const auto [t, lo, hi] = token.At(unit);
      const Pair64* from[kMaxNvlinkRanks];
#pragma unroll
      for (int m = 0; m < kMaxNvlinkRanks; ++m) {
        const int64_t row = member_row(unit, t, m);
        from[m] = row < n * R ? SlotRow<Pair64>(call, me, parity, row, row_parts) + part : nullptr;
      }
      for (int64_t step = lo; step < hi; ++step) {
        const int64_t line = step * kLinesPerWarpStep + lane / kLanesPerLine;
        Pair64 got[kMaxNvlinkRanks];
#pragma unroll
        for (int m = 0; m < kMaxNvlinkRanks; ++m) {
          if (from[m] != nullptr) got[m] = LoadVolatile(from[m] + line * kLanesPerLine);
        }
        // A line is whole once its flag lane sees the call's flag; the warp polls until all of its lines are.
#pragma unroll
        for (int m = 0; m < kMaxNvlinkRanks; ++m) {
          if (from[m] == nullptr) continue;  // the same on every lane
          for (uint32_t spins = 1; !__all_sync(0xffffffffu, !flag_lane || got[m].hi == flag); ++spins) {
            live = live && patience.WarpKeepsWaiting(spins, m);
            if (!live) break;
            got[m] = LoadVolatile(from[m] + line * kLanesPerLine);
          }
        }
        // Traced: when thread 0's first lines arrived, the handshake's end (its rows then take the rest).
        if (threadIdx.x == 0 && unit == first_unit && step == lo) trace.DataArrived();
        const LinePart at(line, part, words);
        float acc[V::kCount] = {};
#pragma unroll
        for (int m = 0; m < kMaxNvlinkRanks; ++m) {
          if (from[m] != nullptr) V::Add(acc, PayloadOf(got[m], at.count), 1.0f);
        }
        StorePayload(out + t * words, at, V::FromFloat(acc));
      }
    }
    if (threadIdx.x == 0 && first_unit >= token.count()) trace.DataArrived();  // a block with no token rows
    // Every member has entered this call, so it finished the last one: the parity half that this rank writes
    // into two calls on is free, as it is where every rank hears from every member (symmetric_layout.h).
    if (blockIdx.x == 0 && threadIdx.x < n) patience.AtLeast(&args.control->entered[threadIdx.x], epoch, threadIdx.x);
  } else {
    uint4* out = static_cast<uint4*>(args.out);
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
        const int64_t row = member_row(unit, t, m);
        from[m] = row < n * R ? SlotRow<uint4>(call, me, parity, row, vectors) : nullptr;
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
  }
  FinishCall(args.control, epoch, ticket, trace, kTraceMoeCombine);
}

}  // namespace

size_t MoeCombineSharedBytes(int top_k) { return size_t{kThreads / 32} * 2 * top_k * sizeof(int32_t); }

bool MoeCombineUsesLines(int size, int64_t rows_per_member, int64_t row_bytes) {
  return size * rows_per_member * LineStepsOf(row_bytes) * kLineStepBytes <= kMoeLinesMaxBytes;
}

int64_t MoeCombineSlotBytes(int size, int64_t rows_per_member, int64_t hidden, int element_bytes) {
  const int64_t row_bytes = hidden * element_bytes;
  const int64_t rows_bytes = MoeCombineUsesLines(size, rows_per_member, row_bytes)
                                 ? size * rows_per_member * LineStepsOf(row_bytes) * kLineStepBytes
                                 : size * rows_per_member * row_bytes;
  return (NvlinkLowLatencyAreaBytes(size) + rows_bytes + 255) / 256 * 256;
}

int ChooseMoeCombineBlocks(const MoeCombineArgs& args, int requested, int sm_count) {
  // A warp per line step (lines) or a thread per 16-byte vector (flags) of the larger side, up to a block per
  // SM (a block may wait for rows another block of its grid writes, so all must be resident at once) and the
  // flags.
  const int64_t row_bytes = args.hidden * FloatTypeBytes(args.type);
  const int64_t rows = std::max(args.size * args.rows_per_member, args.tokens);
  const int64_t by_size = MoeCombineUsesLines(args.size, args.rows_per_member, row_bytes)
                              ? (rows * LineStepsOf(row_bytes) + kThreads / 32 - 1) / (kThreads / 32)
                              : (rows * (row_bytes / 16) + kThreads - 1) / kThreads;
  const int cap = std::min(kMaxMoeCombineBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

template <typename T>
void LaunchTyped(const Call& call, int blocks, size_t shared, cudaStream_t stream) {
  const MoeCombineArgs& args = call.args;
  if (MoeCombineUsesLines(args.size, args.rows_per_member, args.hidden * int64_t{sizeof(T)})) {
    MoeCombineKernel<T, true><<<blocks, kThreads, shared, stream>>>(call);
  } else {
    MoeCombineKernel<T, false><<<blocks, kThreads, shared, stream>>>(call);
  }
}

cudaError_t LaunchMoeCombine(const MoeCombineArgs& args, int blocks, cudaStream_t stream) {
  const Call call{args, NvlinkLowLatencyAreaBytes(args.size)};
  const size_t shared = MoeCombineSharedBytes(args.top_k);
  switch (args.type) {
    case FloatType::kF32:
      LaunchTyped<float>(call, blocks, shared, stream);
      break;
    case FloatType::kBF16:
      LaunchTyped<__nv_bfloat16>(call, blocks, shared, stream);
      break;
    case FloatType::kF16:
      LaunchTyped<__half>(call, blocks, shared, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace jax_ncclx
