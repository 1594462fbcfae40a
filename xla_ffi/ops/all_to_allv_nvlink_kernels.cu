// The NVLink kernel of all_to_allv_dynamic: one launch, no host involvement, counts never leave the GPUs.
//
// Every rank runs the same grid. Each peer's capacity rows are cut into `groups` pieces; a block takes
// pieces to send, then pieces to receive:
//   send (peer, g):    wait until the peer has entered this call (its buffers are free again), write the
//                      rows of piece g into the peer, then raise the peer's arrived[this rank][g] flag;
//   receive (src, g):  wait for arrived[src][g], then finish the piece in y: copy it out of the staging slot
//                      (staged mode) and zero-fill the rows nobody sent.
// Where rows land: "direct" mode (every rank in this process) writes them straight into the peer's output,
// whose address the peer publishes when it enters the call, already in the requested layout; the packed
// layout needs the offsets of the earlier sources, so there every rank first broadcasts its counts. Staged
// mode (ranks in other processes, reached through CUDA IPC) writes into the peer's symmetric staging slot,
// and the receiver copies the rows out.
// Flags hold the call's epoch, kept on the device, so the kernel needs no reset and replays inside CUDA
// graphs. A peer raises `entered` only after its previous call finished, so one set of buffers is enough.
#include <algorithm>
#include <cstdint>

#include "common/all_to_allv_plan.h"
#include "common/symmetric_layout.h"
#include "ops/all_to_allv_kernels.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;
constexpr int64_t kBytesPerGroup = 64 * 1024;  // per piece: enough blocks to keep NVLink busy at small sizes

__device__ __forceinline__ void StoreRelease(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void WaitAtLeast(const uint64_t* flag, uint64_t epoch) {
  while (LoadAcquire(flag) < epoch) {
  }
}

// Staged data is written by other GPUs during this kernel: read it past L1 (ld.global.cg).
template <typename V>
__device__ __forceinline__ V LoadStaged(const V* p) {
  return __ldcg(p);
}

// Copies n units from src to dst with the whole block, kUnroll loads in flight per thread.
template <typename V, bool kStaged>
__device__ __forceinline__ void CopyUnits(V* dst, const V* src, int64_t n) {
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * int64_t{kThreads} < n; i += kUnroll * int64_t{kThreads}) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = kStaged ? LoadStaged(src + i + u * kThreads) : src[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * kThreads] = v[u];
  }
  for (; i < n; i += kThreads) dst[i] = kStaged ? LoadStaged(src + i) : src[i];
}

template <typename V>
__device__ __forceinline__ void ZeroUnits(V* dst, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads) dst[i] = V{};
}

// Rows [lo, hi) of the capacity axis: piece g of `groups`.
__device__ __forceinline__ int64_t PieceStart(int64_t capacity, int g, int groups) {
  return capacity * g / groups;
}

struct Shared {
  int64_t a[kThreads];  // per batch element of the tile: first input row (send) / rows from the source
  int64_t b[kThreads];  // rows delivered to the peer (send) / rows from earlier sources (receive, packed)
  int64_t c[kThreads];  // output row offset at the peer (send) / rows from all sources (receive, packed)
};

// The count slot that `source` fills in `data` (some rank's data region): int32 [B, N, K].
__device__ __forceinline__ int32_t* CountSlot(const NvlinkAllToAllvArgs& args, uint8_t* data, int source) {
  return reinterpret_cast<int32_t*>(data + source * args.counts_slot_bytes);
}

__device__ __forceinline__ const int32_t* LocalCountSlot(const NvlinkAllToAllvArgs& args, int source) {
  return reinterpret_cast<const int32_t*>(args.staging + source * args.counts_slot_bytes);
}

// Rows `source` delivered here in batch element b, summed over chunks (read from this rank's count slots).
__device__ __forceinline__ int64_t RowsFrom(const NvlinkAllToAllvArgs& args, int source, int64_t b) {
  const AllToAllvShape& s = args.shape;
  const int32_t* slot = LocalCountSlot(args, source) + (b * s.num_peers + args.rank) * s.num_chunks;
  int64_t rows = 0;
  for (int64_t k = 0; k < s.num_chunks; ++k) rows += LoadStaged(slot + k);
  return rows;
}

// Direct packed layout: every rank writes its delivered counts for all peers into every peer's count slot
// for it, so that senders can place rows after those of the earlier sources. Run by one block.
__device__ void BroadcastCounts(const NvlinkAllToAllvArgs& args, uint64_t epoch) {
  const AllToAllvShape& s = args.shape;
  const int num_peers = static_cast<int>(s.num_peers);
  if (threadIdx.x < num_peers) WaitAtLeast(&args.control->entered[threadIdx.x], epoch);
  __syncthreads();
  for (int64_t pair = threadIdx.x; pair < s.batch * s.num_peers; pair += kThreads) {
    const int64_t b = pair / s.num_peers;
    const int64_t dest = pair % s.num_peers;
    const int32_t* counts = args.counts + b * s.num_peers * s.num_chunks;
    PlanPeer(counts, s.num_chunks, s.num_rows, s.capacity, dest, [&](int64_t chunk, int32_t rows) {
      for (int reader = 0; reader < num_peers; ++reader) {
        CountSlot(args, args.table->data[reader], args.rank)[pair * s.num_chunks + chunk] = rows;
      }
    });
  }
  __syncthreads();
  if (threadIdx.x < num_peers) {
    __threadfence_system();
    StoreRelease(&args.table->control[threadIdx.x]->counted[args.rank], epoch);
  }
}

template <typename V>
__device__ void SendPiece(const NvlinkAllToAllvArgs& args, Shared& shared, int peer, int g) {
  const AllToAllvShape& s = args.shape;
  const int64_t units_per_row = s.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t lo = PieceStart(s.capacity, g, args.groups);
  const int64_t hi = PieceStart(s.capacity, g + 1, args.groups);
  const bool first_piece = g == 0;
  // Row (b, c) for the peer goes to base + b * batch_stride + (shared.c[b] + c) rows.
  V* base;
  int64_t batch_stride;
  if (args.direct) {
    base = reinterpret_cast<V*>(args.control->output[peer]);
    batch_stride = s.num_peers * s.capacity * units_per_row;
    if (!args.packed) base += args.rank * s.capacity * units_per_row;
  } else {
    base = reinterpret_cast<V*>(args.table->data[peer] + args.rows_offset + args.rank * args.rows_slot_bytes);
    batch_stride = s.capacity * units_per_row;
  }
  // Counts travel with piece 0, except in the direct packed layout, which broadcast them already.
  const bool send_counts = first_piece && !(args.direct && args.packed);
  int32_t* peer_counts = CountSlot(args, args.table->data[peer], args.rank);
  const V* x = static_cast<const V*>(args.x);
  for (int64_t tile = 0; tile < s.batch; tile += kThreads) {
    const int64_t b = tile + threadIdx.x;
    if (b < s.batch) {
      const int32_t* counts = args.counts + b * s.num_peers * s.num_chunks;
      int32_t* delivered_chunks = peer_counts + (b * s.num_peers + peer) * s.num_chunks;
      const PeerPlan plan = PlanPeer(counts, s.num_chunks, s.num_rows, s.capacity, peer,
                                     [&](int64_t chunk, int32_t rows) {
                                       if (send_counts) delivered_chunks[chunk] = rows;
                                     });
      if (first_piece) args.dropped[b * s.num_peers + peer] = plan.dropped;
      int64_t offset = 0;
      if (args.direct && args.packed) {
        for (int q = 0; q < args.rank; ++q) {
          const int32_t* from = LocalCountSlot(args, q) + (b * s.num_peers + peer) * s.num_chunks;
          for (int64_t k = 0; k < s.num_chunks; ++k) offset += LoadStaged(from + k);
        }
      }
      shared.a[threadIdx.x] = plan.first_row;
      shared.b[threadIdx.x] = plan.delivered;
      shared.c[threadIdx.x] = offset;
    }
    __syncthreads();
    for (int64_t i = 0; i < kThreads && tile + i < s.batch; ++i) {
      const int64_t bb = tile + i;
      const int64_t rows = max(int64_t{0}, min(shared.b[i], hi) - lo);
      CopyUnits<V, false>(base + bb * batch_stride + (shared.c[i] + lo) * units_per_row,
                          x + (bb * s.num_rows + shared.a[i] + lo) * units_per_row, rows * units_per_row);
    }
    __syncthreads();
  }
}

template <typename V>
__device__ void ReceivePiece(const NvlinkAllToAllvArgs& args, Shared& shared, int source, int g) {
  const AllToAllvShape& s = args.shape;
  const int64_t units_per_row = s.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t lo = PieceStart(s.capacity, g, args.groups);
  const int64_t hi = PieceStart(s.capacity, g + 1, args.groups);
  const V* slot = reinterpret_cast<const V*>(args.staging + args.rows_offset + source * args.rows_slot_bytes);
  V* y = static_cast<V*>(args.y);
  const int64_t segment_units = s.capacity * units_per_row;
  for (int64_t tile = 0; tile < s.batch; tile += kThreads) {
    const int64_t b = tile + threadIdx.x;
    if (b < s.batch) {
      int64_t before = 0, total = 0;
      for (int q = 0; q < (args.packed ? s.num_peers : 0); ++q) {
        const int64_t rows = RowsFrom(args, q, b);
        if (q < source) before += rows;
        total += rows;
      }
      const int32_t* from = LocalCountSlot(args, source) + (b * s.num_peers + args.rank) * s.num_chunks;
      int32_t* recv_counts = args.recv_counts + (b * s.num_peers + source) * s.num_chunks;
      int64_t mine = 0;
      for (int64_t k = 0; k < s.num_chunks; ++k) {
        const int32_t rows = LoadStaged(from + k);
        mine += rows;
        if (g == 0) recv_counts[k] = rows;
      }
      shared.a[threadIdx.x] = mine;
      shared.b[threadIdx.x] = before;
      shared.c[threadIdx.x] = total;
    }
    __syncthreads();
    for (int64_t i = 0; i < kThreads && tile + i < s.batch; ++i) {
      const int64_t bb = tile + i;
      const int64_t mine = shared.a[i];
      const int64_t live_end = max(lo, min(mine, hi));  // rows [lo, live_end) hold data, [live_end, hi) zeros
      V* data;
      V* zeros;
      if (args.packed) {
        // Data rows go after those of the earlier sources; the zero rows take this source's share of the
        // zero tail (the shares of all sources tile rows [total, N * C)).
        V* out = y + bb * s.num_peers * segment_units;
        data = out + (shared.b[i] + lo) * units_per_row;
        zeros = out + (shared.c[i] + source * s.capacity - shared.b[i] + (live_end - mine)) * units_per_row;
      } else {
        data = y + ((bb * s.num_peers + source) * s.capacity + lo) * units_per_row;
        zeros = data + (live_end - lo) * units_per_row;
      }
      if (!args.direct) {
        CopyUnits<V, true>(data, slot + (bb * s.capacity + lo) * units_per_row, (live_end - lo) * units_per_row);
      }
      ZeroUnits(zeros, (hi - live_end) * units_per_row);
    }
    __syncthreads();
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads) NvlinkAllToAllvKernel(NvlinkAllToAllvArgs args) {
  __shared__ Shared shared;
  const int num_peers = static_cast<int>(args.shape.num_peers);
  const int jobs = num_peers * args.groups;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&args.control->epoch) + 1;
  const bool broadcast_counts = args.direct && args.packed;

  if (blockIdx.x == 0 && threadIdx.x < num_peers) {
    SymmetricControl* peer = args.table->control[threadIdx.x];
    peer->output[args.rank] = reinterpret_cast<uint64_t>(args.y);  // published by the release below
    StoreRelease(&peer->entered[args.rank], epoch);
  }
  if (broadcast_counts && blockIdx.x == gridDim.x - 1) BroadcastCounts(args, epoch);
  // Rotate the peers so that the ranks start on different links.
  for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
    const int peer = (args.rank + job / args.groups) % num_peers;
    const int g = job % args.groups;
    if (threadIdx.x == 0) {
      WaitAtLeast(&args.control->entered[peer], epoch);
      for (int q = 0; broadcast_counts && q < args.rank; ++q) WaitAtLeast(&args.control->counted[q], epoch);
    }
    __syncthreads();
    SendPiece<V>(args, shared, peer, g);
    if (threadIdx.x == 0) {
      __threadfence_system();
      StoreRelease(&args.table->control[peer]->arrived[args.rank][g], epoch);
    }
  }
  for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
    const int source = (args.rank - job / args.groups + num_peers) % num_peers;
    const int g = job % args.groups;
    if (threadIdx.x == 0) {
      // The counts come with piece 0 of each source (or were broadcast); the packed layout needs them all.
      for (int q = 0; q < num_peers; ++q) {
        if (q != source && !args.packed) continue;
        WaitAtLeast(broadcast_counts ? &args.control->counted[q] : &args.control->arrived[q][0], epoch);
      }
      WaitAtLeast(&args.control->arrived[source][g], epoch);
    }
    __syncthreads();
    ReceivePiece<V>(args, shared, source, g);
  }

  // The last block to finish publishes the epoch for the next call on this stream.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&args.control->blocks_done, 1u) == gridDim.x - 1) {
      args.control->blocks_done = 0;
      args.control->epoch = epoch;
      __threadfence();
    }
  }
}

bool AlignedTo(int64_t width, const NvlinkAllToAllvArgs& args) {
  auto aligned = [width](const void* p) { return reinterpret_cast<uintptr_t>(p) % width == 0; };
  // In direct mode the peers' outputs are XLA allocations like ours: as aligned as y.
  return args.shape.row_bytes % width == 0 && aligned(args.x) && aligned(args.y) && aligned(args.staging);
}

}  // namespace

NvlinkStagingLayout LayOutNvlinkStaging(const AllToAllvShape& shape, bool direct) {
  auto align = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  NvlinkStagingLayout layout;
  layout.counts_slot_bytes =
      align(shape.batch * shape.num_peers * shape.num_chunks * static_cast<int64_t>(sizeof(int32_t)));
  layout.rows_slot_bytes = direct ? 0 : align(shape.batch * shape.capacity * shape.row_bytes);
  layout.rows_offset = shape.num_peers * layout.counts_slot_bytes;
  layout.total = layout.rows_offset + shape.num_peers * layout.rows_slot_bytes;
  return layout;
}

NvlinkGrid ChooseNvlinkGrid(const AllToAllvShape& shape, int requested_blocks, int sm_count) {
  const int64_t slot_bytes = shape.batch * shape.capacity * shape.row_bytes;
  const int64_t peers = std::max<int64_t>(1, shape.num_peers);
  int64_t blocks = requested_blocks > 0
                       ? requested_blocks
                       : peers * std::clamp<int64_t>((slot_bytes + kBytesPerGroup - 1) / kBytesPerGroup, 1,
                                                     kMaxFlagGroups);
  // Every block must be resident at once (blocks wait on each other's peers), so at most one per SM.
  blocks = std::clamp<int64_t>(blocks, 1, std::max(1, sm_count));
  NvlinkGrid grid;
  grid.groups = static_cast<int>(std::clamp<int64_t>((blocks + peers - 1) / peers, 1, kMaxFlagGroups));
  grid.blocks = static_cast<int>(blocks);
  return grid;
}

cudaError_t LaunchNvlinkAllToAllv(const NvlinkAllToAllvArgs& args, int blocks, cudaStream_t stream) {
  if (AlignedTo(16, args)) {
    NvlinkAllToAllvKernel<uint4><<<blocks, kThreads, 0, stream>>>(args);
  } else if (AlignedTo(4, args)) {
    NvlinkAllToAllvKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    NvlinkAllToAllvKernel<uint8_t><<<blocks, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace jax_ncclx
