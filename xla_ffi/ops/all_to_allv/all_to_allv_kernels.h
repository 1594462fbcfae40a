// Host launchers of the device kernels of all_to_allv_dynamic. The NCCL path: plan the sends, pack the
// padded send buffer, and compact the padded receive buffer into the packed output. The NVLink path: one
// kernel that writes into the peers' symmetric memory (all_to_allv_nvlink_kernels.cu). Each launcher queues
// its work on `stream` and returns cudaGetLastError() of the launch (cudaSuccess when there is nothing to
// launch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/symmetric_layout.h"

namespace jax_ncclx {

// Sizes shared by the three kernels. A row is what travels: the trailing feature dims of one row of x, as raw
// bytes, followed by the send row's suffix bytes when there is a suffix operand.
struct AllToAllvShape {
  int64_t batch = 0;        // B
  int64_t num_peers = 0;    // N (communicator size)
  int64_t num_chunks = 0;   // K (count entries per peer)
  int64_t num_rows = 0;     // S (send rows per batch element: x's rows, or send_rows' length)
  int64_t source_rows = 0;  // rows of x per batch element (S without send_rows)
  int64_t capacity = 0;     // C (rows each peer can take)
  int64_t row_bytes = 0;     // bytes of one row that travels, suffix included
  int64_t suffix_bytes = 0;  // the trailing bytes of each row taken from the suffix [B, S, suffix_bytes]
};

// One thread per batch element runs PlanSends on counts[b] ([B, N, K] int32), writing delivered_chunks
// [B, N, K], first_row [B, N], delivered [B, N] and dropped [B, N].
cudaError_t LaunchPlanSends(const AllToAllvShape& shape, const int32_t* counts, int32_t* delivered_chunks,
                            int64_t* first_row, int64_t* delivered, int32_t* dropped, cudaStream_t stream);

// Fills send [B, N, C, row_bytes]: row (b, j, c) is send row first_row[b, j] + c of batch element b when
// c < delivered[b, j], else zero bytes. x is [B, X, row_bytes - suffix_bytes]; send row s is x[b, s], or
// x[b, send_rows[b, s]] when send_rows ([B, S] int32) is not null (SourceRow), followed by suffix[b, s] when
// the suffix is not null.
cudaError_t LaunchPackRows(const AllToAllvShape& shape, const void* x, const int32_t* send_rows, const void* suffix,
                           const int64_t* first_row, const int64_t* delivered, void* send, cudaStream_t stream);

// Builds y [B, N * C, row_bytes] from recv [B, N, C, row_bytes], where source j sent
// sum_k recv_counts[b, j, k] rows followed by zero rows: y[b] holds the rows of source 0, then those of
// source 1, ..., then zeros.
cudaError_t LaunchCompactRows(const AllToAllvShape& shape, const void* recv, const int32_t* recv_counts, void* y,
                              cudaStream_t stream);

// Writes row r < sum_k recv_counts[b, j, k] of recv [B, N, C, row_bytes] (the rows from source j) on row
// place[b, j * C + r] of y [B, O, row_bytes] where that is in [0, O); y's other rows are left as they are.
cudaError_t LaunchPlaceRows(const AllToAllvShape& shape, const void* recv, const int32_t* recv_counts,
                            const int32_t* place, int64_t out_rows, void* y, cudaStream_t stream);

// What the NVLink kernel keeps in each rank's symmetric data region (symmetric_layout.h): at the start of
// the low-latency half of the call's parity, N count slots, one per source rank (int32 [B, N, K]: the
// source's delivered counts, indexed by destination); in the staging area, unless ranks write straight into
// each other's outputs ("direct", all ranks in one process), N row slots ([B, C, row_bytes] each) where
// sources stage their rows. Slots are 256-byte aligned.
struct NvlinkAllToAllvLayout {
  int64_t counts_slot_bytes = 0;
  int64_t counts_bytes = 0;  // bytes of each low-latency half the call needs
  int64_t rows_slot_bytes = 0;
  int64_t staging_bytes = 0;  // bytes of staging area the call needs
};
NvlinkAllToAllvLayout LayOutNvlinkAllToAllv(const AllToAllvShape& shape, bool direct);

// Bytes of the NCCL path's workspace (all_to_allv_cuda.cc), which the lowering allocates as a result.
// `received_apart`: the packed layout and placed calls, whose rows NCCL cannot receive where they end up.
int64_t NcclAllToAllvWorkspaceBytes(const AllToAllvShape& shape, bool received_apart);

struct NvlinkAllToAllvArgs {
  AllToAllvShape shape;
  int rank = 0;
  int groups = 1;  // pieces per peer slot, each with its own arrival flag (<= kMaxPiecesPerPeer)
  int rounds = 1;  // staged calls of one tile: each piece is sent, and copied out, in this many rounds
  bool packed = false;
  bool direct = false;  // write rows into the peers' outputs (same process) instead of their staging slots
  bool trace = false;   // record the call's timeline in control->trace
  int64_t site = 0;         // call site, for the fault record
  uint64_t timeout_ns = 0;  // how long a wait for a peer may last (device_sync.cuh, Patience)
  const void* x = nullptr;              // [B, X, row_bytes - suffix_bytes]
  const int32_t* send_rows = nullptr;   // [B, S]: the row of x each send row takes; null: x's rows in order
  const void* suffix = nullptr;         // [B, S, suffix_bytes] appended to each send row; null: none
  const int32_t* counts = nullptr;      // [B, N, K]
  void* y = nullptr;                    // [B, N, C, row_bytes] or [B, N * C, row_bytes]; placed: [B, O, row_bytes]
  // Placed (ragged_all_to_all): row r from source j lands on row place[b, j * C + r] of y, none where that is
  // outside [0, O), and y's other rows keep their values (no zero rows). Null: the padded or packed layout.
  const int32_t* place = nullptr;       // [B, N * C]
  int64_t out_rows = 0;                 // O, rows of y per batch element when placed
  int32_t* recv_counts = nullptr;       // [B, N, K]
  int32_t* dropped = nullptr;           // [B, N]
  const PeerTable* table = nullptr;     // every rank's symmetric memory, as this rank maps it
  SymmetricControl* control = nullptr;  // this rank's control block
  int64_t counts_slot_bytes = 0;        // from NvlinkAllToAllvLayout
  int64_t rows_slot_bytes = 0;
};

// Writes CorruptedCount(counts[i], i) to out[i] for i < n: the send counts of an injected kCorruptCounts
// fault (monitor.h).
cudaError_t LaunchCorruptCounts(const int32_t* counts, int32_t* out, int64_t n, cudaStream_t stream);

// Blocks, pieces per peer and rounds per piece for a call. By size (requested_blocks = 0) at most one block
// per SM; a request may use up to `resident_blocks`, the most that fit on the GPU at once (every block must be
// resident, since blocks wait on each other's peers). Rounds: staged calls (not `direct`) of large pieces.
struct NvlinkGrid {
  int blocks = 1;
  int groups = 1;
  int rounds = 1;
};
NvlinkGrid ChooseNvlinkGrid(const AllToAllvShape& shape, bool direct, int requested_blocks, int sm_count,
                            int resident_blocks);

// How many blocks of the NVLink kernel fit on one SM of the current device (the fewest over its variants).
cudaError_t NvlinkAllToAllvBlocksPerSm(int* blocks);

// Launches the NVLink kernel with `blocks` blocks (from ChooseNvlinkGrid, whose groups and rounds must be in
// args).
cudaError_t LaunchNvlinkAllToAllv(const NvlinkAllToAllvArgs& args, int blocks, cudaStream_t stream);

}  // namespace jax_ncclx
