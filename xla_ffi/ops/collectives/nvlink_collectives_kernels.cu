// NVLink kernels of the small-message collectives (see nvlink_collectives_kernels.h for the algorithms and
// protocols).
//
// Slots: in every rank's data region, the half of call parity p holds one slot per source rank, 256-byte
// aligned and laid out the same on every rank (two-shot: N reduce-scatter slots, then N all-gather slots).
// Direct calls (every rank in this process) write into the peers' outputs instead where they can: the
// two-shot all-gather (no all-gather slots) and all_gather / all_to_all in simple (no slots at all).
// A block b of the grid owns the same byte range of every slot on every rank; with the simple protocol it
// writes its range into the peers, raises flag arrived[rank][b] on each, and waits for arrived[peer][b] from
// each before reading the range it received. Blocks never wait for other blocks of their own rank.
//
// LL128 and LL carry their own flags in the data, so the receiver polls the data itself: no fence or separate
// flag sits on the critical path. Each protocol has its own area at the start of each half, which no other
// protocol writes, so a flag position only ever holds a flag of that protocol:
//   * LL128 lines: slots are multiples of 256 bytes, so every line is 128-byte aligned and its flag (bytes
//     120..127) sits where no call's payload goes. The flag is the call's epoch; epochs only grow and are
//     never 0, so a stale or never-written (zeroed) line never matches.
//   * LL words: every 8-byte word is payload and tag, tag = 1 + epoch mod (2^32 - 1), never 0; a stale word
//     matches only if it went unwritten for exactly a multiple of 2^32 - 1 calls.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/device_sync.cuh"
#include "common/ll128_lines.cuh"
#include "common/symmetric_layout.h"
#include "ops/collectives/nvlink_collectives_kernels.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
// Bytes of one slot range that justify another block: below this, flags cost more than the copy.
constexpr int64_t kBytesPerBlock = 8 * 1024;
// LL words need no flags, so blocks are sized to give each thread about one word per source.
constexpr int64_t kWordsPerBlock = kThreads;
// Two-shot: the all-gather phase uses flags [kGatherFlag, kGatherFlag + blocks).
constexpr int kGatherFlag = kMaxTwoShotBlocks;
// One-shot segments up to this size may travel as LL128 lines or LL words: no fence and no flag on the
// critical path, which is what a call of this size waits for.
constexpr int64_t kLowLatencyMaxBytes = 64 * 1024;
// LL128 lines (ll128_lines.cuh): smaller blocks than the other kernels, so that a 64 KiB segment is pushed by
// many SMs with one part per lane.
constexpr int kLineThreads = 128;
constexpr int kLinesPerBlock = kLineThreads / kLanesPerLine;

int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Bytes at the start of every parity half reserved for each protocol's slots on a communicator of `size`:
// LL words first (what the smallest calls use by default, so they reserve only what they need), then LL128
// lines, then simple.
int64_t LinesSlot(int64_t segment_bytes) { return Align256(LinesOf(segment_bytes) * kLineBytes); }
int64_t LinesArea(int size) { return size * LinesSlot(kLowLatencyMaxBytes); }
int64_t WordsArea(int size) { return size * 2 * kLowLatencyMaxBytes; }

// The slots of one call, identical on every rank.
struct SlotLayout {
  NvlinkProtocol protocol = NvlinkProtocol::kSimple;  // one-shot: the one the segment travels in
  int64_t base = 0;            // where the call's slots start in the half (its protocol's area)
  int64_t segment_bytes = 0;   // one-shot: what each source sends each rank
  int64_t chunk_bytes = 0;     // two-shot: bytes of chunk j (the last one may be shorter), a multiple of 16
  int64_t slot_stride = 0;     // between the slots of consecutive sources, a multiple of 256
  int64_t gather_offset = 0;   // two-shot, not into_outputs: where the all-gather slots start
  int64_t half_bytes = 0;      // what the call needs of each parity half
  // Direct calls where the algorithm allows it: two-shot's all-gather and simple one-shot moves write into the
  // peers' outputs, and take no slots for that step.
  bool into_outputs = false;
};

SlotLayout LayOutSlots(NvlinkCollective op, NvlinkAlgorithm algorithm, NvlinkProtocol protocol, int64_t bytes, int size,
                       int element_bytes, bool direct) {
  SlotLayout layout;
  const int64_t simple_base = NvlinkLowLatencyAreaBytes(size);
  if (algorithm == NvlinkAlgorithm::kTwoShot) {
    // Chunks of whole 16-byte packs, so every chunk boundary keeps the vector path aligned.
    const int64_t elements = bytes / element_bytes;
    const int64_t pack = std::max(1, 16 / element_bytes);
    const int64_t chunk_elements = ((elements + size - 1) / size + pack - 1) / pack * pack;
    layout.chunk_bytes = chunk_elements * element_bytes;
    layout.base = simple_base;
    layout.slot_stride = Align256(layout.chunk_bytes);
    layout.gather_offset = size * layout.slot_stride;
    layout.into_outputs = direct;
    layout.half_bytes = layout.base + (layout.into_outputs ? 1 : 2) * size * layout.slot_stride;
    return layout;
  }
  const int64_t segment = SendsBlocks(op) ? bytes / size : bytes;
  const bool low_latency = segment % 4 == 0 && segment <= kLowLatencyMaxBytes;
  layout.segment_bytes = segment;
  layout.protocol = low_latency ? protocol : NvlinkProtocol::kSimple;
  switch (layout.protocol) {
    case NvlinkProtocol::kLL:
      layout.base = 0;
      layout.slot_stride = Align256(2 * segment);
      break;
    case NvlinkProtocol::kLL128:
      layout.base = WordsArea(size);
      layout.slot_stride = LinesSlot(segment);
      break;
    case NvlinkProtocol::kSimple:
      layout.base = simple_base;
      layout.slot_stride = Align256(segment);
      break;
  }
  layout.into_outputs = direct && layout.protocol == NvlinkProtocol::kSimple && !Reduces(op);
  layout.half_bytes = layout.base + (layout.into_outputs ? 0 : size * layout.slot_stride);
  return layout;
}

struct Call {
  NvlinkCollectiveArgs args;
  SlotLayout slots;
};

// `source`'s slot in `owner`'s region for calls of `parity`, at `offset` bytes into the half.
template <typename V>
__device__ __forceinline__ V* Slot(const Call& call, int owner, int parity, int source, int64_t offset = 0) {
  const PeerTable* table = call.args.table;
  return reinterpret_cast<V*>(table->data[owner] + parity * table->parity_half_bytes + call.slots.base + offset +
                              source * call.slots.slot_stride);
}

// The call a kernel runs: its epoch, the parity half it uses, and its timeline (started here). Calls through
// slots write into their peers without waiting for them, so "peers entered" is the start (direct moves stamp
// it again after their wait; the record keeps the latest).
struct CallState {
  uint64_t epoch;
  uint32_t ticket;
  int parity;
  CallTrace trace;
  Patience<> patience;

  __device__ CallState(const NvlinkCollectiveArgs& args, TraceKernel kernel)
      : epoch(CallEpoch(args.control)),
        ticket(TakeTicket(args.control, epoch)),
        parity(static_cast<int>(epoch & 1)),
        trace(args.control, epoch, args.trace),
        patience(args.table, args.control, args.rank, args.size, epoch, kernel, args.site, args.timeout_ns) {
    if (threadIdx.x == 0) {
      trace.Start();
      trace.PeersEntered();
    }
  }
};

// This block's share [lo, hi) of n units.
__device__ __forceinline__ void BlockRange(int64_t n, int64_t* lo, int64_t* hi) {
  *lo = n * blockIdx.x / gridDim.x;
  *hi = n * (blockIdx.x + 1) / gridDim.x;
}

// After the block's writes into the peers: flag `flag` of this rank on every peer says they landed.
__device__ __forceinline__ void RaiseFlags(const Call& call, int flag, uint64_t epoch) {
  __syncthreads();  // every thread's writes come before the releases
  const int peer = threadIdx.x;
  if (peer < call.args.size && peer != call.args.rank) {
    StoreRelease(&call.args.table->control[peer]->arrived[call.args.rank][flag], epoch);
  }
}

// Whether the flag `flag_of(peer)` of every peer reached `epoch`. One that never does makes the wait give up
// (Patience); the block then goes on with stale slots.
template <typename FlagOf>
__device__ __forceinline__ bool WaitForPeers(const Call& call, uint64_t epoch, Patience<>& patience, FlagOf&& flag_of) {
  const int peer = threadIdx.x;
  bool came = true;
  if (peer < call.args.size && peer != call.args.rank) {
    came = patience.AtLeastUnaborted(flag_of(peer), epoch, peer);  // the flags gate writes into peers' outputs
  }
  return !__syncthreads_or(!came);
}

__device__ __forceinline__ bool WaitFlags(const Call& call, int flag, uint64_t epoch, Patience<>& patience) {
  return WaitForPeers(call, epoch, patience, [&](int peer) { return &call.args.control->arrived[peer][flag]; });
}

// Direct calls: publishes this rank's output to every peer (PublishOutput), one thread per peer. The thread
// that writes a peer's address releases the flags on that peer, so the address is there before any flag that
// tells the peer to read it.
__device__ __forceinline__ void PublishOutputToPeers(const Call& call, uint64_t epoch, bool enter) {
  const int peer = threadIdx.x;
  if (peer < call.args.size && peer != call.args.rank) {
    PublishOutput(call.args.table->control[peer], call.args.rank, call.args.y, epoch, enter);
  }
}

// ---- reductions --------------------------------------------------------------------------------------------

template <typename T>
struct Accumulate {  // accumulate in T itself
  using Type = T;
  __device__ static Type From(T v) { return v; }
  __device__ static T To(Type v) { return v; }
};
template <>
struct Accumulate<__nv_bfloat16> {
  using Type = float;
  __device__ static float From(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 To(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Accumulate<__half> {
  using Type = float;
  __device__ static float From(__half v) { return __half2float(v); }
  __device__ static __half To(float v) { return __float2half_rn(v); }
};

template <ReduceOp kOp, typename A>
__device__ __forceinline__ A Combine(A a, A b) {
  if constexpr (kOp == ReduceOp::kSum) return a + b;
  if constexpr (kOp == ReduceOp::kMax) return b > a ? b : a;
  if constexpr (kOp == ReduceOp::kMin) return b < a ? b : a;
}

// Reduces units [lo, hi) of the n sources in rank order (the same bits on every rank) and writes the result
// to every output. A unit V packs sizeof(V) / sizeof(T) elements.
template <typename T, ReduceOp kOp>
struct Reduce {
  static constexpr bool kMoves = false;

  template <typename V>
  __device__ static void Range(const V* const* sources, int n, V* const* outputs, int num_outputs, int64_t lo,
                               int64_t hi) {
    using A = typename Accumulate<T>::Type;
    constexpr int kPack = sizeof(V) / sizeof(T);
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      A acc[kPack];
      {
        const V unit = __ldcg(sources[0] + i);
        const T* values = reinterpret_cast<const T*>(&unit);
#pragma unroll
        for (int p = 0; p < kPack; ++p) acc[p] = Accumulate<T>::From(values[p]);
      }
      for (int s = 1; s < n; ++s) {
        const V unit = __ldcg(sources[s] + i);
        const T* values = reinterpret_cast<const T*>(&unit);
#pragma unroll
        for (int p = 0; p < kPack; ++p) acc[p] = Combine<kOp>(acc[p], Accumulate<T>::From(values[p]));
      }
      V result;
      T* out = reinterpret_cast<T*>(&result);
#pragma unroll
      for (int p = 0; p < kPack; ++p) out[p] = Accumulate<T>::To(acc[p]);
      for (int o = 0; o < num_outputs; ++o) outputs[o][i] = result;
    }
  }

  // Combines one 4-byte word of each of the n sources, in rank order.
  __device__ static uint32_t Words(const uint32_t* words, int n) {
    using A = typename Accumulate<T>::Type;
    constexpr int kPack = sizeof(uint32_t) / sizeof(T);
    A acc[kPack];
    const T* first = reinterpret_cast<const T*>(&words[0]);
#pragma unroll
    for (int p = 0; p < kPack; ++p) acc[p] = Accumulate<T>::From(first[p]);
#pragma unroll
    for (int s = 1; s < kMaxNvlinkRanks; ++s) {  // unrolled, so that `words` stays in registers
      if (s >= n) break;
      const T* values = reinterpret_cast<const T*>(&words[s]);
#pragma unroll
      for (int p = 0; p < kPack; ++p) acc[p] = Combine<kOp>(acc[p], Accumulate<T>::From(values[p]));
    }
    uint32_t result;
    T* out = reinterpret_cast<T*>(&result);
#pragma unroll
    for (int p = 0; p < kPack; ++p) out[p] = Accumulate<T>::To(acc[p]);
    return result;
  }
};

struct Move {  // all_gather and all_to_all: bytes are copied, never combined
  static constexpr bool kMoves = true;
};

TraceKernel TraceKernelOf(NvlinkCollective op) {
  switch (op) {
    case NvlinkCollective::kAllReduce:
      return kTraceAllReduce;
    case NvlinkCollective::kAllGather:
      return kTraceAllGather;
    case NvlinkCollective::kAllToAll:
      return kTraceAllToAll;
    case NvlinkCollective::kReduceScatter:
      return kTraceReduceScatter;
  }
  return kTraceAllReduce;
}

// ---- kernels -----------------------------------------------------------------------------------------------

template <typename V, typename Op>
__global__ void __launch_bounds__(kThreads) OneShotKernel(Call call, TraceKernel kernel) {
  const NvlinkCollectiveArgs& args = call.args;
  CallState state(args, kernel);
  const uint64_t epoch = state.epoch;
  const int parity = state.parity;
  CallTrace& trace = state.trace;
  const int n = args.size;
  const int me = args.rank;
  const bool scatter = SendsBlocks(args.op);  // peer j gets block j of x, not all of it
  const int64_t units = call.slots.segment_bytes / static_cast<int64_t>(sizeof(V));
  int64_t lo, hi;
  BlockRange(units, &lo, &hi);
  const V* x = static_cast<const V*>(args.x);
  V* y = static_cast<V*>(args.y);
  // Direct moves: this rank's block goes straight into each peer's output, once the peer has entered the call
  // and published it; nothing is left to copy out of slots.
  const bool direct = Op::kMoves && call.slots.into_outputs;
  bool send = true;
  if (direct) {
    if (blockIdx.x == 0) PublishOutputToPeers(call, epoch, /*enter=*/true);
    // After a wait that gave up, an address may be a past call's: write no peer.
    send = WaitForPeers(call, epoch, state.patience, [&](int peer) { return &args.control->entered[peer]; });
    if (threadIdx.x == 0) trace.PeersEntered();
  }

  for (int k = 1; send && k < n; ++k) {  // rotated, so the ranks start on different links
    const int peer = (me + k) % n;
    V* to = direct ? PeerOutput<V>(call.args.control, peer) + me * units : Slot<V>(call, peer, parity, me);
    BlockCopy<V, false, kThreads>(to, x + (scatter ? peer * units : 0), lo, hi);
  }
  RaiseFlags(call, blockIdx.x, epoch);
  if (threadIdx.x == 0) trace.Sent();
  if constexpr (Op::kMoves) {  // this rank's own block, while the peers' data travels
    BlockCopy<V, false, kThreads>(y + me * units, x + (scatter ? me * units : 0), lo, hi);
  }
  WaitFlags(call, blockIdx.x, epoch, state.patience);
  if (threadIdx.x == 0) trace.DataArrived();

  if constexpr (Op::kMoves) {
    for (int k = 1; !direct && k < n; ++k) {
      const int source = (me + k) % n;
      BlockCopy<V, true, kThreads>(y + source * units, Slot<V>(call, me, parity, source), lo, hi);
    }
  } else {
    const V* sources[kMaxNvlinkRanks];
    for (int s = 0; s < n; ++s) sources[s] = s == me ? x + (scatter ? me * units : 0) : Slot<V>(call, me, parity, s);
    V* const outputs[1] = {y};
    Op::Range(sources, n, outputs, 1, lo, hi);
  }
  FinishCall(args.control, epoch, state.ticket, trace, kernel);
}

__device__ __forceinline__ uint32_t Tag(uint64_t epoch) { return 1 + static_cast<uint32_t>(epoch % 0xffffffffull); }

// Word i of every peer's slot on this rank, into values[peer] (values[me] is left alone). The loads of all
// peers go out together, so a thread pays one memory latency, not one per peer; only words that had not
// landed yet are polled again.
__device__ __forceinline__ void ReadWords(const Call& call, Patience<>& patience, int parity, uint32_t tag, int64_t i,
                                          uint32_t* values) {
  const int n = call.args.size;
  const int me = call.args.rank;
  uint64_t seen[kMaxNvlinkRanks];
#pragma unroll
  for (int s = 0; s < kMaxNvlinkRanks; ++s) {
    if (s < n && s != me) seen[s] = LoadRelaxed(Slot<uint64_t>(call, me, parity, s) + i);
  }
#pragma unroll
  for (int s = 0; s < kMaxNvlinkRanks; ++s) {
    if (s < n && s != me) {
      values[s] = static_cast<uint32_t>(seen[s] >> 32) == tag
                      ? static_cast<uint32_t>(seen[s])
                      : patience.Word(Slot<uint64_t>(call, me, parity, s) + i, tag, s);
    }
  }
}

// One-shot with LL words: x and y are read and written as 4-byte words.
template <typename Op>
__global__ void __launch_bounds__(kThreads) OneShotWordsKernel(Call call, TraceKernel kernel) {
  const NvlinkCollectiveArgs& args = call.args;
  CallState state(args, kernel);
  const uint64_t epoch = state.epoch;
  const int parity = state.parity;
  CallTrace& trace = state.trace;
  const uint32_t tag = Tag(epoch);
  const int n = args.size;
  const int me = args.rank;
  const bool scatter = SendsBlocks(args.op);
  const int64_t words = call.slots.segment_bytes / 4;
  int64_t lo, hi;
  BlockRange(words, &lo, &hi);
  const uint32_t* x = static_cast<const uint32_t*>(args.x);
  uint32_t* y = static_cast<uint32_t*>(args.y);

  for (int k = 1; k < n; ++k) {
    const int peer = (me + k) % n;
    uint64_t* slot = Slot<uint64_t>(call, peer, parity, me);
    const uint32_t* source = x + (scatter ? peer * words : 0);
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      StoreRelaxed(slot + i, static_cast<uint64_t>(tag) << 32 | source[i]);
    }
  }
  if (threadIdx.x == 0) trace.Sent();
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    uint32_t values[kMaxNvlinkRanks];
    ReadWords(call, state.patience, parity, tag, i, values);
    if constexpr (Op::kMoves) {
      y[me * words + i] = x[(scatter ? me * words : 0) + i];
      for (int k = 1; k < n; ++k) {
        const int source = (me + k) % n;
        y[source * words + i] = values[source];
      }
    } else {
      values[me] = x[(scatter ? me * words : 0) + i];
      y[i] = Op::Words(values, n);
    }
  }
  if (args.trace) {
    __syncthreads();
    if (threadIdx.x == 0) trace.DataArrived();
  }
  FinishCall(args.control, epoch, state.ticket, trace, kernel);
}

// Words [first, first + count) of a 4-byte-word array of `words` words, zeros past its end.
__device__ __forceinline__ void LoadWords(const uint32_t* x, int64_t words, int64_t first, int count, uint32_t* w) {
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = j < count && first + j < words ? x[first + j] : 0u;
}

// One-shot with LL128 lines. Every warp takes 4 consecutive lines at a time (a lane: part lane % 8 of line
// lane / 8), in step, so that the 8 lanes of a line store and load it with one instruction; x and y are read
// and written as 4-byte words.
template <typename Op>
__global__ void __launch_bounds__(kLineThreads) OneShotLinesKernel(Call call, TraceKernel kernel) {
  const NvlinkCollectiveArgs& args = call.args;
  CallState state(args, kernel);
  const uint64_t epoch = state.epoch;
  const int parity = state.parity;
  CallTrace& trace = state.trace;
  const int n = args.size;
  const int me = args.rank;
  const bool scatter = SendsBlocks(args.op);
  const int64_t words = call.slots.segment_bytes / 4;
  const int64_t lines = LinesOf(call.slots.segment_bytes);
  const int lane = threadIdx.x % 32;
  const int part = lane % kLanesPerLine;
  const bool flag_lane = part == kLanesPerLine - 1;
  const int count = flag_lane ? 2 : 4;  // payload words of this lane's part
  const int64_t warps = int64_t{gridDim.x} * (kLineThreads / 32);
  const int64_t warp = int64_t{blockIdx.x} * (kLineThreads / 32) + threadIdx.x / 32;
  const uint32_t* x = static_cast<const uint32_t*>(args.x);
  uint32_t* y = static_cast<uint32_t*>(args.y);
  auto part_of = [&](int owner, int source, int64_t line) {
    return Slot<Pair64>(call, owner, parity, source) + line * kLanesPerLine + part;
  };
  auto pack = [&](const uint32_t* w) {
    const uint64_t lo = w[0] | static_cast<uint64_t>(w[1]) << 32;
    return Pair64{lo, flag_lane ? epoch : w[2] | static_cast<uint64_t>(w[3]) << 32};
  };

  for (int64_t step = warp * kLinesPerWarpStep; step < lines; step += warps * kLinesPerWarpStep) {
    const int64_t line = step + lane / kLanesPerLine;
    if (line >= lines) continue;
    const int64_t first = line * kLinePayloadWords + part * 4;
    uint32_t w[4];
    if (!scatter) LoadWords(x, words, first, count, w);
    for (int k = 1; k < n; ++k) {  // rotated, so the ranks start on different links
      const int peer = (me + k) % n;
      if (scatter) LoadWords(x + peer * words, words, first, count, w);
      StoreVolatile(part_of(peer, me, line), pack(w));
    }
  }
  if (threadIdx.x == 0) trace.Sent();

  for (int64_t step = warp * kLinesPerWarpStep; step < lines; step += warps * kLinesPerWarpStep) {
    const int64_t line = step + lane / kLanesPerLine;
    const bool valid = line < lines;
    const int64_t first = line * kLinePayloadWords + part * 4;
    Pair64 got[kMaxNvlinkRanks];
#pragma unroll
    for (int s = 0; s < kMaxNvlinkRanks; ++s) {
      if (s < n && s != me && valid) got[s] = LoadVolatile(part_of(me, s, line));
    }
    // A line is whole once its flag lane sees the epoch; the warp polls again until all 4 lines are.
#pragma unroll
    for (int s = 0; s < kMaxNvlinkRanks; ++s) {
      if (s >= n || s == me) continue;
      for (uint32_t spins = 1; !__all_sync(0xffffffffu, !valid || !flag_lane || got[s].hi == epoch); ++spins) {
        if (!state.patience.WarpKeepsWaiting(spins, s)) break;
        if (valid) got[s] = LoadVolatile(part_of(me, s, line));
      }
    }
    if (!valid) continue;
    uint32_t own[4];
    LoadWords(x + (scatter ? me * words : 0), words, first, count, own);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= count || first + j >= words) break;
      if constexpr (Op::kMoves) {
#pragma unroll
        for (int s = 0; s < kMaxNvlinkRanks; ++s) {
          if (s < n) y[s * words + first + j] = s == me ? own[j] : WordOf(got[s], j);
        }
      } else {
        uint32_t values[kMaxNvlinkRanks];
#pragma unroll
        for (int s = 0; s < kMaxNvlinkRanks; ++s) {
          if (s < n) values[s] = s == me ? own[j] : WordOf(got[s], j);
        }
        y[first + j] = Op::Words(values, n);
      }
    }
  }
  if (args.trace) {
    __syncthreads();
    if (threadIdx.x == 0) trace.DataArrived();
  }
  FinishCall(args.control, epoch, state.ticket, trace, kernel);
}

// Reduce-scatter through the slots, then all-gather: rank j owns chunk j. Direct: rank j writes its reduced
// chunk straight into every peer's output; a peer's address comes with its reduce-scatter flag, which this
// block has seen before it writes (the address is that of the peer's output in this call).
template <typename V, typename Op>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(Call call, TraceKernel kernel) {
  const NvlinkCollectiveArgs& args = call.args;
  CallState state(args, kernel);
  const uint64_t epoch = state.epoch;
  const int parity = state.parity;
  CallTrace& trace = state.trace;
  const int n = args.size;
  const int me = args.rank;
  const int64_t total = args.bytes / static_cast<int64_t>(sizeof(V));
  const int64_t chunk = call.slots.chunk_bytes / static_cast<int64_t>(sizeof(V));
  int64_t lo, hi;
  BlockRange(chunk, &lo, &hi);
  // This block's range of chunk j, clipped to the chunk's length (the last chunks may be short or empty).
  auto end_in = [&](int j) { return min(hi, max(int64_t{0}, min(chunk, total - j * chunk))); };
  const V* x = static_cast<const V*>(args.x);
  V* y = static_cast<V*>(args.y);

  const bool direct = call.slots.into_outputs;
  if (direct) PublishOutputToPeers(call, epoch, /*enter=*/false);  // the reduce-scatter flags bring it
  for (int k = 1; k < n; ++k) {
    const int peer = (me + k) % n;
    BlockCopy<V, false, kThreads>(Slot<V>(call, peer, parity, me), x + peer * chunk, lo, end_in(peer));
  }
  RaiseFlags(call, blockIdx.x, epoch);
  const bool peers_sent = WaitFlags(call, blockIdx.x, epoch, state.patience);

  const V* sources[kMaxNvlinkRanks];
  for (int s = 0; s < n; ++s) sources[s] = s == me ? x + me * chunk : Slot<V>(call, me, parity, s);
  V* outputs[kMaxNvlinkRanks];
  int num_outputs = 0;
  outputs[num_outputs++] = y + me * chunk;
  for (int k = 1; k < n; ++k) {
    const int peer = (me + k) % n;
    if (!direct) {
      outputs[num_outputs++] = Slot<V>(call, peer, parity, me, call.slots.gather_offset);
    } else if (peers_sent) {  // after a wait that gave up, an address may be a past call's: write no peer
      outputs[num_outputs++] = PeerOutput<V>(call.args.control, peer) + me * chunk;
    }
  }
  Op::Range(sources, n, outputs, num_outputs, lo, end_in(me));
  RaiseFlags(call, kGatherFlag + blockIdx.x, epoch);
  if (threadIdx.x == 0) trace.Sent();
  WaitFlags(call, kGatherFlag + blockIdx.x, epoch, state.patience);
  if (threadIdx.x == 0) trace.DataArrived();

  for (int k = 1; !direct && k < n; ++k) {
    const int source = (me + k) % n;
    BlockCopy<V, true, kThreads>(y + source * chunk, Slot<V>(call, me, parity, source, call.slots.gather_offset), lo,
                                 end_in(source));
  }
  FinishCall(args.control, epoch, state.ticket, trace, kernel);
}

// ---- launch ------------------------------------------------------------------------------------------------

bool Aligned(const void* p, int64_t width) { return reinterpret_cast<uintptr_t>(p) % width == 0; }

template <typename V, typename Op>
cudaError_t LaunchAs(const Call& call, int blocks, cudaStream_t stream) {
  const TraceKernel kernel = TraceKernelOf(call.args.op);
  if (call.slots.protocol != NvlinkProtocol::kSimple) {
    // XLA's buffers are always aligned; the LL128 and LL areas must never hold anything but their lines / words.
    if (!Aligned(call.args.x, 4) || !Aligned(call.args.y, 4)) return cudaErrorMisalignedAddress;
    if (call.slots.protocol == NvlinkProtocol::kLL128) {
      OneShotLinesKernel<Op><<<blocks, kLineThreads, 0, stream>>>(call, kernel);
    } else {
      OneShotWordsKernel<Op><<<blocks, kThreads, 0, stream>>>(call, kernel);
    }
    return cudaGetLastError();
  }
  if constexpr (!Op::kMoves) {
    if (call.args.algorithm == NvlinkAlgorithm::kTwoShot) {
      TwoShotKernel<V, Op><<<blocks, kThreads, 0, stream>>>(call, kernel);
      return cudaGetLastError();
    }
  }
  OneShotKernel<V, Op><<<blocks, kThreads, 0, stream>>>(call, kernel);
  return cudaGetLastError();
}

// The scalar unit of an element type: same size, loadable with __ldcg.
template <typename T>
using ScalarUnit = std::conditional_t<sizeof(T) == 2, unsigned short, unsigned int>;

template <typename T, ReduceOp kOp>
cudaError_t LaunchReduce(const Call& call, int blocks, cudaStream_t stream) {
  // 16-byte units when every range the kernel touches starts on a 16-byte boundary (slot offsets and
  // two-shot chunk boundaries always do; a reduce_scatter's blocks when they are multiples of 16 bytes).
  const bool vector = call.args.bytes % 16 == 0 && call.slots.segment_bytes % 16 == 0 && Aligned(call.args.x, 16) &&
                      Aligned(call.args.y, 16);
  return vector ? LaunchAs<uint4, Reduce<T, kOp>>(call, blocks, stream)
                : LaunchAs<ScalarUnit<T>, Reduce<T, kOp>>(call, blocks, stream);
}

template <typename T>
cudaError_t LaunchReduceType(const Call& call, int blocks, cudaStream_t stream) {
  switch (call.args.reduce) {
    case ReduceOp::kSum:
      return LaunchReduce<T, ReduceOp::kSum>(call, blocks, stream);
    case ReduceOp::kMax:
      return LaunchReduce<T, ReduceOp::kMax>(call, blocks, stream);
    case ReduceOp::kMin:
      return LaunchReduce<T, ReduceOp::kMin>(call, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int64_t NvlinkLowLatencyAreaBytes(int size) { return WordsArea(size) + LinesArea(size); }

int64_t NvlinkCollectiveSlotBytes(NvlinkCollective op, NvlinkAlgorithm algorithm, NvlinkProtocol protocol,
                                  int64_t bytes, int size, int element_bytes, bool direct) {
  return LayOutSlots(op, algorithm, protocol, bytes, size, element_bytes, direct).half_bytes;
}

int ChooseNvlinkCollectiveBlocks(const NvlinkCollectiveArgs& args, int requested, int sm_count) {
  const SlotLayout slots = LayOutSlots(args.op, args.algorithm, args.protocol, args.bytes, args.size,
                                       args.element_bytes, args.direct);
  const bool two_shot = args.algorithm == NvlinkAlgorithm::kTwoShot;
  const int64_t range_bytes = two_shot ? slots.chunk_bytes : slots.segment_bytes;
  int64_t by_size = (range_bytes + kBytesPerBlock - 1) / kBytesPerBlock;
  if (!two_shot && slots.protocol == NvlinkProtocol::kLL128) {
    by_size = (LinesOf(range_bytes) + kLinesPerBlock - 1) / kLinesPerBlock;
  } else if (!two_shot && slots.protocol == NvlinkProtocol::kLL) {
    by_size = (range_bytes / 4 + kWordsPerBlock - 1) / kWordsPerBlock;
  }
  const int64_t cap = std::min(two_shot ? kMaxTwoShotBlocks : kMaxOneShotBlocks, std::max(1, sm_count));
  return static_cast<int>(std::clamp<int64_t>(requested > 0 ? requested : by_size, 1, cap));
}

cudaError_t LaunchNvlinkCollective(const NvlinkCollectiveArgs& args, int blocks, cudaStream_t stream) {
  const Call call{args, LayOutSlots(args.op, args.algorithm, args.protocol, args.bytes, args.size, args.element_bytes,
                                    args.direct)};
  if (!Reduces(args.op)) {
    const int64_t segment = call.slots.segment_bytes;
    auto fits = [&](int64_t width) { return segment % width == 0 && Aligned(args.x, width) && Aligned(args.y, width); };
    if (fits(16)) return LaunchAs<uint4, Move>(call, blocks, stream);
    if (fits(4)) return LaunchAs<unsigned int, Move>(call, blocks, stream);
    return LaunchAs<unsigned char, Move>(call, blocks, stream);
  }
  switch (args.reduce_type) {
    case ReduceType::kF32:
      return LaunchReduceType<float>(call, blocks, stream);
    case ReduceType::kBF16:
      return LaunchReduceType<__nv_bfloat16>(call, blocks, stream);
    case ReduceType::kF16:
      return LaunchReduceType<__half>(call, blocks, stream);
    case ReduceType::kS32:
      return LaunchReduceType<int32_t>(call, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_ncclx
