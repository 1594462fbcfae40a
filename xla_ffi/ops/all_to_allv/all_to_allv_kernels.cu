// Device kernels of all_to_allv_dynamic (plan, pack, compact, place) and their host launchers. Device code only:
// the XLA handler that drives them lives in all_to_allv_cuda.cc.
#include "ops/all_to_allv/all_to_allv_kernels.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include <cub/block/block_reduce.cuh>

#include "common/all_to_allv_plan.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTargetBlocks = 132 * 4;  // a few resident blocks on every SM of an H100
constexpr int64_t kMaxGridY = 65535;

__global__ void CorruptCountsKernel(const int32_t* __restrict__ counts, int32_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = CorruptedCount(counts[i], i);
  }
}

__global__ void PlanSendsKernel(AllToAllvShape shape, const int32_t* __restrict__ counts,
                                int32_t* __restrict__ delivered_chunks, int64_t* __restrict__ first_row,
                                int64_t* __restrict__ delivered, int32_t* __restrict__ dropped) {
  const int64_t per_batch = shape.num_peers * shape.num_chunks;
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; b < shape.batch;
       b += int64_t{gridDim.x} * blockDim.x) {
    PlanSends(counts + b * per_batch, shape.num_peers, shape.num_chunks, shape.num_rows, shape.capacity,
              delivered_chunks + b * per_batch, first_row + b * shape.num_peers, delivered + b * shape.num_peers,
              dropped + b * shape.num_peers);
  }
}

// Both copy kernels walk segments (b, peer) of C rows each: blockIdx.y strides over segments, the x
// dimension over the segment's units (V-sized pieces of its rows).
template <typename V>
__global__ void PackRowsKernel(AllToAllvShape shape, int64_t units_per_row, int64_t suffix_units,
                               const V* __restrict__ x, const int32_t* __restrict__ send_rows,
                               const V* __restrict__ suffix, const int64_t* __restrict__ first_row,
                               const int64_t* __restrict__ delivered, V* __restrict__ send) {
  const int64_t segments = shape.batch * shape.num_peers;
  const int64_t segment_units = shape.capacity * units_per_row;
  const int64_t x_units = units_per_row - suffix_units;
  // The rows for one peer are contiguous send rows (PlanSends); without an index or a suffix, contiguous in
  // x too, and copied without working out each unit's row.
  const bool contiguous = send_rows == nullptr && suffix == nullptr;
  for (int64_t segment = blockIdx.y; segment < segments; segment += gridDim.y) {
    const int64_t b = segment / shape.num_peers;
    V* dst = send + segment * segment_units;
    const int64_t live = delivered[segment] * units_per_row;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < segment_units;
         i += int64_t{gridDim.x} * blockDim.x) {
      if (i >= live) {
        dst[i] = V{};
        continue;
      }
      if (contiguous) {
        dst[i] = x[(b * shape.source_rows + first_row[segment]) * units_per_row + i];
        continue;
      }
      const int64_t row = i / units_per_row;
      const int64_t unit = i - row * units_per_row;
      const int64_t send_row = first_row[segment] + row;
      if (unit >= x_units) {
        dst[i] = suffix[(b * shape.num_rows + send_row) * suffix_units + unit - x_units];
        continue;
      }
      const int64_t source = SourceRow(send_rows, shape.num_rows, shape.source_rows, b, send_row);
      dst[i] = source < 0 ? V{} : x[source * x_units + unit];
    }
  }
}

// Rows of one batch element's receive counts: from the sources before this one, from this one, from all.
struct RowSums {
  int64_t before;
  int64_t mine;
  int64_t total;
};

struct AddRowSums {
  __device__ RowSums operator()(const RowSums& a, const RowSums& b) const {
    return {a.before + b.before, a.mine + b.mine, a.total + b.total};
  }
};

template <typename V>
__global__ void __launch_bounds__(kThreads)
    CompactRowsKernel(AllToAllvShape shape, int64_t units_per_row, const V* __restrict__ recv,
                      const int32_t* __restrict__ recv_counts, V* __restrict__ y) {
  using BlockReduce = cub::BlockReduce<RowSums, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ RowSums shared_sums;
  const int64_t segments = shape.batch * shape.num_peers;
  const int64_t segment_units = shape.capacity * units_per_row;
  const int64_t counts_per_batch = shape.num_peers * shape.num_chunks;
  for (int64_t segment = blockIdx.y; segment < segments; segment += gridDim.y) {
    const int64_t b = segment / shape.num_peers;
    const int64_t source = segment % shape.num_peers;
    const int32_t* counts = recv_counts + b * counts_per_batch;
    // The counts came from the peers, so each source's rows are clamped to [0, C] here, as a sender caps
    // them: counts that an aborted NCCL call never wrote must not move a row outside y.
    RowSums partial{0, 0, 0};
    for (int64_t from = threadIdx.x; from < shape.num_peers; from += blockDim.x) {
      int64_t rows = 0;
      for (int64_t chunk = 0; chunk < shape.num_chunks; ++chunk) {
        rows += max(counts[from * shape.num_chunks + chunk], 0);
      }
      rows = min(rows, shape.capacity);
      partial.total += rows;
      if (from < source) partial.before += rows;
      if (from == source) partial.mine += rows;
    }
    const RowSums block_sums = BlockReduce(reduce_storage).Reduce(partial, AddRowSums());
    if (threadIdx.x == 0) shared_sums = block_sums;
    __syncthreads();
    const RowSums sums = shared_sums;
    __syncthreads();  // the next segment reuses the shared storage

    // Every sender caps a peer at C rows and zero-fills the rest, so this segment holds `mine` rows and then
    // C - mine zero rows. The data rows go after those of the earlier sources; the zero rows take this
    // source's share of y[b]'s zero tail (the shares of all sources tile rows [total, N * C)).
    const V* src = recv + segment * segment_units;
    V* out = y + b * shape.num_peers * segment_units;
    V* data = out + sums.before * units_per_row;
    V* zeros = out + (sums.total + source * shape.capacity - sums.before) * units_per_row;
    const int64_t live = sums.mine * units_per_row;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < segment_units;
         i += int64_t{gridDim.x} * blockDim.x) {
      if (i < live) {
        data[i] = src[i];
      } else {
        zeros[i - live] = V{};
      }
    }
  }
}

// One block row per (batch element, source) segment, as CompactRowsKernel: the segment's rows go to the rows of
// y that `place` names. Its rows are clamped to [0, C] as there, and a place outside [0, O) writes nothing.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    PlaceRowsKernel(AllToAllvShape shape, int64_t units_per_row, const V* __restrict__ recv,
                    const int32_t* __restrict__ recv_counts, const int32_t* __restrict__ place, int64_t out_rows,
                    V* __restrict__ y) {
  const int64_t segments = shape.batch * shape.num_peers;
  for (int64_t segment = blockIdx.y; segment < segments; segment += gridDim.y) {
    const int64_t b = segment / shape.num_peers;
    int64_t rows = 0;
    for (int64_t chunk = 0; chunk < shape.num_chunks; ++chunk) {
      rows += max(recv_counts[segment * shape.num_chunks + chunk], 0);
    }
    const int64_t live = min(rows, shape.capacity) * units_per_row;
    const V* src = recv + segment * shape.capacity * units_per_row;
    const int32_t* slots = place + segment * shape.capacity;
    V* out = y + b * out_rows * units_per_row;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < live; i += int64_t{gridDim.x} * blockDim.x) {
      const int64_t row = slots[i / units_per_row];
      if (row >= 0 && row < out_rows) out[row * units_per_row + i % units_per_row] = src[i];
    }
  }
}

// Enough blocks to fill the GPU when there are few segments, never more than the segment has work for.
dim3 SegmentGrid(int64_t segments, int64_t segment_units) {
  const int64_t y = std::min(segments, kMaxGridY);
  const int64_t wanted_x = (kTargetBlocks + y - 1) / y;
  const int64_t needed_x = (segment_units + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted_x, needed_x))), static_cast<unsigned>(y));
}

bool AlignedTo(int64_t width, std::initializer_list<int64_t> sizes, std::initializer_list<const void*> buffers) {
  return std::all_of(sizes.begin(), sizes.end(), [width](int64_t bytes) { return bytes % width == 0; }) &&
         std::all_of(buffers.begin(), buffers.end(),
                     [width](const void* p) { return reinterpret_cast<uintptr_t>(p) % width == 0; });
}

// Calls launch(V{}) with the widest copy unit (16, 4 or 1 bytes) that divides every size and aligns every
// buffer (a null buffer aligns to anything).
template <typename Launch>
cudaError_t WithWidestUnit(std::initializer_list<int64_t> sizes, std::initializer_list<const void*> buffers,
                           Launch launch) {
  if (AlignedTo(16, sizes, buffers)) return launch(uint4{});
  if (AlignedTo(4, sizes, buffers)) return launch(uint32_t{});
  return launch(uint8_t{});
}

}  // namespace

cudaError_t LaunchCorruptCounts(const int32_t* counts, int32_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, kTargetBlocks);
  CorruptCountsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(counts, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchPlanSends(const AllToAllvShape& shape, const int32_t* counts, int32_t* delivered_chunks,
                            int64_t* first_row, int64_t* delivered, int32_t* dropped, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  constexpr int kPlanThreads = 128;
  const int64_t blocks = std::min((shape.batch + kPlanThreads - 1) / kPlanThreads, kTargetBlocks);
  PlanSendsKernel<<<static_cast<unsigned>(blocks), kPlanThreads, 0, stream>>>(shape, counts, delivered_chunks,
                                                                              first_row, delivered, dropped);
  return cudaGetLastError();
}

cudaError_t LaunchPackRows(const AllToAllvShape& shape, const void* x, const int32_t* send_rows, const void* suffix,
                           const int64_t* first_row, const int64_t* delivered, void* send, cudaStream_t stream) {
  const int64_t segments = shape.batch * shape.num_peers;
  if (segments == 0 || shape.capacity == 0 || shape.row_bytes == 0) return cudaSuccess;
  return WithWidestUnit({shape.row_bytes, shape.suffix_bytes}, {x, suffix, send}, [&](auto unit) {
    using V = decltype(unit);
    const int64_t units_per_row = shape.row_bytes / static_cast<int64_t>(sizeof(V));
    const int64_t suffix_units = shape.suffix_bytes / static_cast<int64_t>(sizeof(V));
    PackRowsKernel<V><<<SegmentGrid(segments, shape.capacity * units_per_row), kThreads, 0, stream>>>(
        shape, units_per_row, suffix_units, static_cast<const V*>(x), send_rows, static_cast<const V*>(suffix),
        first_row, delivered, static_cast<V*>(send));
    return cudaGetLastError();
  });
}

cudaError_t LaunchCompactRows(const AllToAllvShape& shape, const void* recv, const int32_t* recv_counts, void* y,
                              cudaStream_t stream) {
  const int64_t segments = shape.batch * shape.num_peers;
  if (segments == 0 || shape.capacity == 0 || shape.row_bytes == 0) return cudaSuccess;
  return WithWidestUnit({shape.row_bytes}, {recv, y}, [&](auto unit) {
    using V = decltype(unit);
    const int64_t units_per_row = shape.row_bytes / static_cast<int64_t>(sizeof(V));
    CompactRowsKernel<V><<<SegmentGrid(segments, shape.capacity * units_per_row), kThreads, 0, stream>>>(
        shape, units_per_row, static_cast<const V*>(recv), recv_counts, static_cast<V*>(y));
    return cudaGetLastError();
  });
}

cudaError_t LaunchPlaceRows(const AllToAllvShape& shape, const void* recv, const int32_t* recv_counts,
                            const int32_t* place, int64_t out_rows, void* y, cudaStream_t stream) {
  const int64_t segments = shape.batch * shape.num_peers;
  if (segments == 0 || shape.capacity == 0 || shape.row_bytes == 0 || out_rows == 0) return cudaSuccess;
  return WithWidestUnit({shape.row_bytes}, {recv, y}, [&](auto unit) {
    using V = decltype(unit);
    const int64_t units_per_row = shape.row_bytes / static_cast<int64_t>(sizeof(V));
    PlaceRowsKernel<V><<<SegmentGrid(segments, shape.capacity * units_per_row), kThreads, 0, stream>>>(
        shape, units_per_row, static_cast<const V*>(recv), recv_counts, place, out_rows, static_cast<V*>(y));
    return cudaGetLastError();
  });
}

}  // namespace jax_ncclx
