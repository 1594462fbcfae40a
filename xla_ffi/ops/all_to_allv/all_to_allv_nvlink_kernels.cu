// The NVLink kernel of all_to_allv_dynamic: one launch, no host involvement, counts never leave the GPUs.
//
// Every rank runs the same grid. Each peer's capacity rows are cut into `groups` interleaved pieces
// (ForEachSlice); a block takes pieces to send, then pieces to receive:
//   send (peer, g):    plan the piece (where its rows start, how many reach the peer; for a block's first
//                      piece while the peers enter), wait until the peer has entered this call (its buffers
//                      are free again), write the rows of piece g into the peer, then raise the peer's
//                      arrived[this rank][g] flag;
//   receive (src, g):  wait for arrived[src][g]; in staged mode then finish the piece: recv_counts, the copy
//                      out of the staging slot and the zero rows; in direct mode, the zero rows if the
//                      source left them (LeavesZeros).
// Where rows land: "direct" mode (every rank in this process) writes them, the zero rows after them and the
// peer's recv_counts straight into the peer's outputs, whose addresses the peer publishes when it enters the
// call, already in the requested layout, so that a receiver has nothing left to do once its flags are up;
// the packed layout needs the counts of the other sources, so there every rank shares its counts with all
// ranks as it enters. Where a peer's zero rows are many, sending them over NVLink costs more than the work
// they leave the receiver: the sender then leaves them, and says so in the pieces' flags. Staged mode (ranks
// in other processes, reached through CUDA IPC) writes into the peer's symmetric staging slot, and the
// receiver copies the rows out.
// Placed calls (ragged_all_to_all, args.place) put row r from source j on the row of y that the receiver's
// place table names for (j, r), in direct mode the sender through the table the receiver publishes as it
// enters; they write no zero rows, so y's other rows keep the values XLA left there (its output operand).
// Flags hold the call's epoch, kept on the device, so the kernel needs no reset and replays inside CUDA
// graphs. A peer raises `entered` only after its previous call finished, so one set of row buffers is enough.
#include <algorithm>
#include <cstdint>

#include "common/all_to_allv_plan.h"
#include "common/device_sync.cuh"
#include "common/symmetric_layout.h"
#include "common/warp_copy.cuh"
#include "ops/all_to_allv/all_to_allv_kernels.h"

namespace jax_ncclx {
namespace {

constexpr int kThreads = 512;
// One SM pushes ~10 GB/s into NVLink, so small messages need many blocks; pieces below this size cost more in
// flags than they gain.
constexpr int64_t kMinBytesPerPiece = 8 * 1024;
// Pieces per peer, each with its own flag: as many as there are flags, so that an exchange with one or two
// members still gets a block on most SMs (with 4 or more, the SM count binds first).
constexpr int kMaxPiecesPerPeer = kMaxFlagGroups;
static_assert(kMaxPiecesPerPeer <= kMaxFlagGroups);
// Direct mode: from this many bytes of zero rows for one peer up, the sender leaves them to the receiver. The
// receiver's work after its piece arrives costs ~2.5 µs more at the end of the call: with ~1 MiB of zero rows
// per peer that was slower than sending them on 2xH200.
constexpr int64_t kMinZeroBytesLeftToReceiver = 2 << 20;
// Staged mode: pieces of at least this many bytes per round are sent, and copied out of the staging slot, in
// rounds (at most kMaxRounds), so that the copy out runs while later rounds are still on the wire instead of
// after the last of them (see the receive loop of NvlinkAllToAllvKernel). 256 KiB rather than 512 gives the
// MoE exchanges at T = 4096 (~0.92 MB pieces) three rounds: their round trip took 2% less on 2xH200 with a
// process per GPU.
constexpr int64_t kMinBytesPerRound = 256 * 1024;
constexpr int kMaxRounds = 8;
static_assert(kMaxRounds < (1 << kRoundBits));

// Rows are moved in slices of 2^k units, a warp per slice, so that a few wide rows still spread over many
// warps: at least one pass of WarpCopy's loop (32 lanes x 4 units), at most 1024 units.
constexpr int kMinSliceShift = 7;
constexpr int kMaxSliceShift = 10;

// log2 of the units per slice for rows of `units` units: the smallest slice with which the warps of a peer's
// pieces cover a full slot of C rows one slice each, so that a small call is not left to a few warps each
// walking whole rows, one memory round trip after another (the MoE dispatch at T = 16 sends ~16 rows to a
// peer). It depends on the static shape only, so the sender's piece g and the receiver's (staged mode) cover
// the same slices.
__device__ __forceinline__ int SliceShift(const NvlinkAllToAllvArgs& args, int64_t units) {
  const int64_t warps = int64_t{args.groups} * (kThreads / 32);
  const int64_t per_warp = (args.shape.capacity * units + warps - 1) / warps;
  int shift = kMinSliceShift;
  while (shift < kMaxSliceShift && (int64_t{1} << shift) < per_warp) ++shift;
  return shift;
}

// Round `index` of `count` of a piece: the piece's slices among the index-th count-th of all slices.
struct Round {
  int index = 0;
  int count = 1;
};

// Piece g of `groups` of `rows` rows of `units` units: the slices w with w % groups == g, where slice w is
// units [lo, hi) of row w / (slices per row) (SliceShift gives their size), those of `round` alone.
// `move(row, lo, hi)` moves one slice with the calling warp.
// The pieces interleave, rather than each taking a contiguous range of rows, so that the blocks writing one
// peer write neighbouring addresses at any moment, and one warp-per-slice path serves x rows, gathered rows,
// suffixes and zero rows alike. What made the exchange faster is the order of the blocks
// (NvlinkAllToAllvKernel); the interleaving alone was not measured faster.
template <typename Move>
__device__ __forceinline__ void ForEachSlice(const NvlinkAllToAllvArgs& args, int64_t rows, int64_t units, int g,
                                             Move&& move, Round round = {}) {
  constexpr int kWarps = kThreads / 32;
  const int groups = args.groups;
  const int shift = SliceShift(args, units);
  const int64_t slice = int64_t{1} << shift;
  const int64_t per_row = max(int64_t{1}, (units + slice - 1) >> shift);
  const int64_t stride = int64_t{groups} * kWarps;
  const int64_t slices = rows * per_row;
  const int64_t first = slices * round.index / round.count;
  const int64_t end = slices * (round.index + 1) / round.count;
  int64_t w = g + int64_t{groups} * (threadIdx.x / 32);
  if (w < first) w += (first - w + stride - 1) / stride * stride;  // this warp's first slice of the round
  for (; w < end; w += stride) {
    const int64_t lo = w % per_row * slice;
    move(w / per_row, lo, min(lo + slice, units));
  }
}

// Count arrays are tiny, but a thread that walks one in global memory pays a memory latency per element
// (~0.5 µs; a plan reads up to N * K of them). So each tile of batch elements first stages the counts it
// needs in shared memory, loaded by the whole block at once. Tiles hold at most this many counts; when one
// batch element alone needs more, the block reads global memory instead.
constexpr int64_t kStagedCounts = 2048;

// From this many chunks per peer, the plan made before the peer enters gives each batch element a warp
// (WarpPlanPeer) rather than a thread (PlanPeer), in a variant of the kernel of its own (kWarpPlan). With one
// chunk per member, as the MoE exchanges, the warp's shuffles cost more than the thread's walk (the moe
// dispatch took 0.3 µs longer with the warp, one H100), and the warp's code alone, never run, made their
// round trip 0.5 µs slower (one H100).
constexpr int64_t kMinChunksForWarpPlan = 8;

struct Shared {
  int64_t a[kThreads];  // per batch element of the tile: first input row (send) / rows from the source
  int64_t b[kThreads];  // rows delivered to the peer (send) / rows from earlier sources (receive, packed)
  int64_t c[kThreads];  // rows from earlier sources at the peer (send) / from all sources (receive, packed)
  int64_t d[kThreads];  // rows from all sources at the peer (send, direct packed)
  unsigned long long zero_rows;  // the zero rows after the planned tile's rows at the peer (send)
  int peer_entered;              // whether the peer of the block's first piece entered (awaited during its plan)
  int32_t send[kStagedCounts];   // this rank's send counts of the tile's batch elements
  int32_t slots[kStagedCounts];  // what every source delivered to one rank, from the count slots; or Emit::kShared
};

// The staging area of `rank`'s data region (symmetric_layout.h), read from the peer table at run time.
__device__ __forceinline__ uint8_t* Staging(const NvlinkAllToAllvArgs& args, int rank) {
  return args.table->data[rank] + 2 * args.table->parity_half_bytes;
}

// The count slot that `source` fills in `owner`'s data region in calls of `parity`: int32 [B, N, K], in the
// low-latency half of the call's parity. Two sets of slots, by call parity, because in the direct packed
// layout a rank shares its counts before its peers have finished the previous call (see ShareCounts); the
// halves' places do not depend on the call's shape, so a call cannot write over the counts that a peer still
// reads for a previous call of another shape.
__device__ __forceinline__ int32_t* CountSlot(const NvlinkAllToAllvArgs& args, int owner, int parity, int source) {
  return reinterpret_cast<int32_t*>(args.table->data[owner] + parity * args.table->parity_half_bytes +
                                    source * args.counts_slot_bytes);
}

__device__ __forceinline__ const int32_t* LocalCountSlot(const NvlinkAllToAllvArgs& args, int parity, int source) {
  return CountSlot(args, args.rank, parity, source);
}

// The counts of one tile of batch elements [first, first + size): this rank's send counts, and the rows
// every source delivered to `dest` (from this rank's count slots), staged in shared memory when they fit.
class TileCounts {
 public:
  // Batch elements per tile: as many as fit in the staging arrays (at most one per thread), else 1.
  __host__ __device__ static int64_t TileSize(const AllToAllvShape& s) {
    const int64_t per_element = s.num_peers * s.num_chunks;
    return per_element == 0 ? kThreads : max(int64_t{1}, min(int64_t{kThreads}, kStagedCounts / per_element));
  }

  // Stages the tile (the caller synchronizes the block before reading): `with_send`, this rank's send counts
  // (off when a plan made before the peer entered left them in shared memory already, or when only the count
  // slots are read); `with_slots`, the count slots.
  __device__ TileCounts(const NvlinkAllToAllvArgs& args, Shared& shared, int parity, int64_t first, int64_t size,
                        int dest, bool with_send, bool with_slots)
      : num_peers_(args.shape.num_peers),
        num_chunks_(args.shape.num_chunks),
        capacity_(static_cast<int32_t>(min(args.shape.capacity, int64_t{INT32_MAX}))) {
    const int64_t per_element = num_peers_ * num_chunks_;
    const int32_t* slot0 = LocalCountSlot(args, parity, 0) + (first * num_peers_ + dest) * num_chunks_;
    if (size * per_element > kStagedCounts) {  // one element needing more than the arrays hold: global memory
      send_ = args.counts + first * per_element;
      slots_ = slot0;
      source_stride_ = args.counts_slot_bytes / static_cast<int64_t>(sizeof(int32_t));
      element_stride_ = per_element;
      return;
    }
    for (int64_t i = threadIdx.x; with_send && i < size * per_element; i += kThreads) {
      shared.send[i] = args.counts[first * per_element + i];
    }
    const int64_t per_source = size * num_chunks_;
    for (int64_t i = threadIdx.x; with_slots && i < num_peers_ * per_source; i += kThreads) {
      const int64_t source = i / per_source;
      const int64_t element = i % per_source / num_chunks_;
      const int64_t chunk = i % num_chunks_;
      shared.slots[i] = LoadStaged(LocalCountSlot(args, parity, static_cast<int>(source)) +
                                   ((first + element) * num_peers_ + dest) * num_chunks_ + chunk);
    }
    send_ = shared.send;
    slots_ = shared.slots;
    source_stride_ = per_source;
    element_stride_ = num_chunks_;
  }

  // Send counts [N, K] of element i of the tile.
  __device__ const int32_t* Send(int64_t i) const { return send_ + i * num_peers_ * num_chunks_; }
  // Rows of chunk k that `source` delivered to `dest` in element i. Slots hold what the sender planned, but
  // a call that gave up waiting (Patience) reads stale ones, so every value is clamped to [0, capacity] and
  // every sum to the capacity: offsets computed from them stay inside the receiver's rows.
  __device__ int32_t Delivered(int source, int64_t i, int64_t k) const {
    return min(max(slots_[source * source_stride_ + i * element_stride_ + k], 0), capacity_);
  }
  __device__ int64_t RowsFrom(int source, int64_t i) const {
    int64_t rows = 0;
    for (int64_t k = 0; k < num_chunks_; ++k) rows += Delivered(source, i, k);
    return min(rows, int64_t{capacity_});
  }

 private:
  int64_t num_peers_;
  int64_t num_chunks_;
  int32_t capacity_;
  const int32_t* send_;
  const int32_t* slots_;
  int64_t source_stride_;
  int64_t element_stride_;
};

// Direct packed layout: before entering the call, a rank writes its delivered counts for every destination
// into every rank's count slot for it, so that senders can place their rows after those of the earlier
// sources and zero the tail. Peers may still be reading the previous call's counts, hence the parity: a
// peer that is still in call e-1 reads the other set, and none can be in call e-2 (this rank finished e-1,
// which needed every peer's rows of e-1). Run by block 0; the caller's release of `entered` publishes them.
__device__ void ShareCounts(const NvlinkAllToAllvArgs& args, Shared& shared, int parity) {
  const AllToAllvShape& s = args.shape;
  const int64_t tile_size = TileCounts::TileSize(s);
  for (int64_t tile = 0; tile < s.batch; tile += tile_size) {
    const int64_t size = min(tile_size, s.batch - tile);
    const TileCounts counts(args, shared, parity, tile, size, args.rank, /*with_send=*/true, /*with_slots=*/false);
    __syncthreads();
    for (int64_t pair = threadIdx.x; pair < size * s.num_peers; pair += kThreads) {
      const int64_t i = pair / s.num_peers;
      const int64_t dest = pair % s.num_peers;
      const int64_t offset = ((tile + i) * s.num_peers + dest) * s.num_chunks;
      PlanPeer(counts.Send(i), s.num_chunks, s.num_rows, s.capacity, dest, [&](int64_t chunk, int32_t rows) {
        for (int reader = 0; reader < s.num_peers; ++reader) {
          CountSlot(args, reader, parity, args.rank)[offset + chunk] = rows;
        }
      });
    }
    __syncthreads();
  }
}

// Whether the call is one tile of batch elements (TileCounts), as the MoE exchanges: the blocks then plan
// their first piece while the peers enter, and in direct mode a sender may leave zero rows to the receiver.
__device__ __forceinline__ bool OneTile(const NvlinkAllToAllvArgs& args) {
  return TileCounts::TileSize(args.shape) >= args.shape.batch;
}

// Where a plan writes what reaches the peer: nowhere, the peer's count slot for this rank (indexed by
// destination; staged mode, where the receiver places the piece by it, every piece so that a receiver waits
// for no other piece than its own), the peer's recv_counts [B, N, K] (piece 0 in direct mode, once the peer
// has entered and published their address), or shared.slots [B, K] (piece 0's plan made before the peer
// entered, in direct mode: copied into the peer's recv_counts once it has, CopyRecvCounts).
enum class Emit { kNone, kSlot, kRecvCounts, kShared };

// Whether piece 0 of a call whose first tile was planned before the peer entered keeps what reaches the peer
// in shared memory (Emit::kShared), so that after the wait its block copies it with every thread instead of
// one thread planning the tile again: direct mode, calls of one tile whose [B, K] counts fit.
__device__ __forceinline__ bool RecvCountsInShared(const NvlinkAllToAllvArgs& args) {
  return args.direct && args.shape.batch * args.shape.num_chunks <= kStagedCounts;
}

// Writes the [B, K] counts that piece 0's early plan left in shared.slots (Emit::kShared) into `peer`'s
// recv_counts, whose address the peer published as it entered. Every thread takes some.
__device__ void CopyRecvCounts(const NvlinkAllToAllvArgs& args, const Shared& shared, int peer) {
  const AllToAllvShape& s = args.shape;
  int32_t* recv_counts = reinterpret_cast<int32_t*>(args.control->recv_counts[peer]);
  for (int i = threadIdx.x; i < s.batch * s.num_chunks; i += kThreads) {
    const int b = i / static_cast<int>(s.num_chunks);
    recv_counts[(b * s.num_peers + args.rank) * s.num_chunks + i % s.num_chunks] = shared.slots[i];
  }
}

// Plans tile [tile, tile + size) of this rank's sends to `peer` into shared: the first input row and the rows
// delivered, in the direct packed layout the rows from earlier sources and from all sources at the peer, and
// the zero rows after the tile's rows. Writes what reaches the peer where `emit` says, and with `dropped`
// (piece 0) this rank's dropped rows for the peer. `counts_in_shared`: the tile's send counts are in shared
// memory already. kWarpPlan (the plan made before the peer enters, in the kernel's variant for calls of
// kMinChunksForWarpPlan chunks per peer or more): a warp plans each batch element (WarpPlanPeer) where the
// tile has no more of them than the block has warps; a thread each otherwise. Only there, because inlined in
// SendPiece too it pushed every variant of the kernel past its 128 registers (ptxas -v: spills). The block's
// last thread runs `meanwhile` (which must not synchronize the block) while the others plan.
template <bool kWarpPlan, typename Meanwhile>
__device__ void PlanTile(const NvlinkAllToAllvArgs& args, Shared& shared, int parity, int peer, int64_t tile,
                         int64_t size, Emit emit, bool dropped, bool counts_in_shared, Meanwhile&& meanwhile) {
  const AllToAllvShape& s = args.shape;
  const bool direct_packed = args.direct && args.packed;
  const TileCounts counts(args, shared, parity, tile, size, peer, !counts_in_shared, /*with_slots=*/direct_packed);
  if (threadIdx.x == 0) shared.zero_rows = 0;
  __syncthreads();
  constexpr int kWarps = kThreads / 32;
  const bool warp_per_element = kWarpPlan && size <= kWarps;
  const int64_t i = warp_per_element ? threadIdx.x / 32 : threadIdx.x;
  if (i < size) {
    const int64_t b = tile + i;
    int32_t* delivered_chunks = nullptr;  // row b of the peer's count slot for this rank, or of its recv_counts
    if (emit == Emit::kSlot) {
      delivered_chunks = CountSlot(args, peer, parity, args.rank) + (b * s.num_peers + peer) * s.num_chunks;
    } else if (emit == Emit::kShared) {
      delivered_chunks = shared.slots + b * s.num_chunks;
    } else if (emit == Emit::kRecvCounts) {
      delivered_chunks = reinterpret_cast<int32_t*>(args.control->recv_counts[peer]) +
                         (b * s.num_peers + args.rank) * s.num_chunks;
    }
    const PeerPlan plan = warp_per_element ? WarpPlanPeer(counts.Send(i), s.num_chunks, s.num_rows, s.capacity, peer,
                                                          delivered_chunks)
                                           : PlanPeer(counts.Send(i), s.num_chunks, s.num_rows, s.capacity, peer,
                                                      [&](int64_t chunk, int32_t rows) {
                                                        if (delivered_chunks != nullptr) delivered_chunks[chunk] = rows;
                                                      });
    if (!warp_per_element || threadIdx.x % 32 == 0) {
      if (dropped) args.dropped[b * s.num_peers + peer] = plan.dropped;
      int64_t before = 0, total = 0;
      for (int q = 0; direct_packed && q < s.num_peers; ++q) {
        const int64_t rows = counts.RowsFrom(q, i);
        if (q < args.rank) before += rows;
        total += rows;
      }
      shared.a[i] = plan.first_row;
      shared.b[i] = min(plan.delivered, s.capacity);
      shared.c[i] = before;
      shared.d[i] = total;
      atomicAdd(&shared.zero_rows, static_cast<unsigned long long>(s.capacity - shared.b[i]));
    }
  }
  if (threadIdx.x == kThreads - 1) meanwhile();
  __syncthreads();
}

// Whether this rank leaves the zero rows after its rows at `peer` to the peer (direct mode, calls of one tile,
// other ranks): when they are many, kMinZeroBytesLeftToReceiver. Read after PlanTile planned the tile.
__device__ __forceinline__ bool LeavesZeros(const NvlinkAllToAllvArgs& args, const Shared& shared, int peer) {
  return args.direct && OneTile(args) && peer != args.rank &&
         static_cast<int64_t>(shared.zero_rows) * args.shape.row_bytes >= kMinZeroBytesLeftToReceiver;
}

// Writes piece g of this rank's rows for `peer` (ForEachSlice). Send row s of batch element b takes its
// leading units from x through args.send_rows (a row whose index falls outside x becomes zeros, SourceRow),
// the rest from args.suffix. Direct mode also writes the zero rows of the piece, so the peer's output is
// complete when the piece's flag is raised, unless it leaves them to the peer (LeavesZeros): returns whether
// it did. `planned`: PlanTile ran for the first tile before the peer entered, with every write but the peer's
// recv_counts, whose address the peer publishes when it enters (piece 0 in direct mode copies them from
// shared memory, CopyRecvCounts, or where they did not fit there plans again from the staged counts).
// `round`: the part of the piece to write (calls of one tile, whose plan the first round leaves in shared
// memory for the others). kInRounds, kPlaced: as the kernel's (staged calls only, so piece 0 never copies counts).
template <typename V, bool kInRounds, bool kPlaced>
__device__ bool SendPiece(const NvlinkAllToAllvArgs& args, Shared& shared, int parity, int peer, int g, bool planned,
                          Round round) {
  const AllToAllvShape& s = args.shape;
  const int64_t units_per_row = s.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t suffix_units = s.suffix_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t x_units = units_per_row - suffix_units;
  const bool first_piece = g == 0;
  const bool placed = kPlaced && args.direct;  // rows go where the peer's place table says
  bool leaves_zeros = false;
  // Row (b, c) for the peer goes to base + b * batch_stride + (shared.c[b] + c) rows; placed, to row
  // place[b, rank * C + c] of the peer's [B, O] rows.
  V* base;
  int64_t batch_stride;
  if (placed) {
    base = PeerOutput<V>(args.control, peer);
    batch_stride = args.out_rows * units_per_row;
  } else if (args.direct) {
    base = PeerOutput<V>(args.control, peer);
    batch_stride = s.num_peers * s.capacity * units_per_row;
    if (!args.packed) base += args.rank * s.capacity * units_per_row;
  } else {
    base = reinterpret_cast<V*>(Staging(args, peer) + args.rank * args.rows_slot_bytes);
    batch_stride = s.capacity * units_per_row;
  }
  const V* x = static_cast<const V*>(args.x);
  const V* suffix = static_cast<const V*>(args.suffix);
  const int64_t tile_size = TileCounts::TileSize(s);
  for (int64_t tile = 0; tile < s.batch; tile += tile_size) {
    const int64_t size = min(tile_size, s.batch - tile);
    const bool planned_tile = planned && tile == 0;
    const Emit emit = first_piece && args.direct      ? Emit::kRecvCounts
                      : !planned_tile && !args.direct ? Emit::kSlot
                                                      : Emit::kNone;
    if (!kInRounds && round.index == 0 && planned_tile && emit == Emit::kRecvCounts && RecvCountsInShared(args)) {
      CopyRecvCounts(args, shared, peer);
    } else if (round.index == 0 && (!planned_tile || emit == Emit::kRecvCounts)) {
      PlanTile<false>(args, shared, parity, peer, tile, size, emit, first_piece && !planned_tile, planned_tile, [] {});
    }
    leaves_zeros = !kPlaced && LeavesZeros(args, shared, peer);
    const bool with_zeros = args.direct && !placed && !leaves_zeros;
    for (int64_t i = 0; i < size; ++i) {
      const int64_t bb = tile + i;
      const int64_t first = shared.a[i];
      const int64_t delivered = shared.b[i];
      V* out = base + bb * batch_stride;
      V* data = out + shared.c[i] * units_per_row;  // row r at data + r rows
      // Zero row r (with_zeros, r >= delivered) at zeros + (r - delivered) rows. Padded: the rest of this
      // rank's segment. Packed: this rank's share of the zero tail after all sources' rows (the shares of all
      // sources tile rows [total, N * C), see ReceivePiece).
      V* zeros = args.packed ? out + (shared.d[i] + args.rank * s.capacity - shared.c[i]) * units_per_row
                             : data + delivered * units_per_row;
      const int32_t* places =  // placed: the peer's place table for this rank's rows
          placed ? reinterpret_cast<const int32_t*>(args.control->place[peer]) +
                       (bb * s.num_peers + args.rank) * s.capacity
                 : nullptr;
      ForEachSlice(
          args, with_zeros ? s.capacity : delivered, units_per_row, g,
          [&](int64_t r, int64_t lo, int64_t hi) {
            if (r >= delivered) return WarpZero(zeros + (r - delivered) * units_per_row + lo, hi - lo);
            int64_t at = r;
            if (kPlaced && places != nullptr) {
              at = places[r];
              if (at < 0 || at >= args.out_rows) return;
            }
            V* row = data + at * units_per_row;
            const int64_t send_row = first + r;
            const int64_t source = SourceRow(args.send_rows, s.num_rows, s.source_rows, bb, send_row);
            const int64_t x_hi = min(hi, x_units);
            if (lo < x_hi && source < 0) WarpZero(row + lo, x_hi - lo);
            if (lo < x_hi && source >= 0) WarpCopy<V, false>(row + lo, x + source * x_units + lo, x_hi - lo);
            const int64_t suffix_lo = max(lo, x_units);
            if (suffix_lo < hi) {
              WarpCopy<V, false>(row + suffix_lo,
                                 suffix + (bb * s.num_rows + send_row) * suffix_units + suffix_lo - x_units,
                                 hi - suffix_lo);
            }
          },
          round);
    }
    __syncthreads();
  }
  return leaves_zeros;
}

// Finishes piece g of `source`'s rows here. Staged mode: recv_counts (piece 0), the copy of the piece's slices
// out of the staging slot and its zero rows; `arrived` false (the wait for the piece gave up, Patience): the
// piece's rows are zeros, and so are its recv_counts. Direct mode, when the source left its zero rows
// (LeavesZeros): those zero rows. The counts that place the piece are in the count slots (staged mode,
// Emit::kSlot; the direct packed layout, ShareCounts), or in the direct padded layout in recv_counts, which
// the source's piece 0 wrote. `round`: the part of the piece's rows to copy out (the same part as the source's
// SendPiece wrote); the first round also writes the zero rows and recv_counts. kInRounds, kPlaced: as the
// kernel's.
template <typename V, bool kInRounds, bool kPlaced>
__device__ void ReceivePiece(const NvlinkAllToAllvArgs& args, Shared& shared, int parity, int source, int g,
                             bool arrived, Round round) {
  const AllToAllvShape& s = args.shape;
  const int64_t units_per_row = s.row_bytes / static_cast<int64_t>(sizeof(V));
  const V* slot = reinterpret_cast<const V*>(Staging(args, args.rank) + source * args.rows_slot_bytes);
  V* y = static_cast<V*>(args.y);
  const int64_t segment_units = s.capacity * units_per_row;
  const bool from_slots = !args.direct || args.packed;
  const int64_t tile_size = TileCounts::TileSize(s);
  for (int64_t tile = 0; tile < s.batch; tile += tile_size) {
    const int64_t size = min(tile_size, s.batch - tile);
    const TileCounts counts(args, shared, parity, tile, size, args.rank, /*with_send=*/false, from_slots);
    __syncthreads();
    if (threadIdx.x < size) {
      const int64_t i = threadIdx.x;
      int32_t* recv_counts = args.recv_counts + ((tile + i) * s.num_peers + source) * s.num_chunks;
      // Packed: rows from the earlier sources and from all. Each count is read once, so that the rows placed
      // from them stay inside y even when a call that gave up waiting reads counts a late peer is writing.
      int64_t mine = 0, before = 0, total = 0;
      for (int64_t k = 0; !from_slots && k < s.num_chunks; ++k) mine += max(LoadStaged(recv_counts + k), 0);
      if (from_slots && !args.packed) mine = counts.RowsFrom(source, i);
      for (int q = 0; args.packed && q < s.num_peers; ++q) {
        const int64_t rows = counts.RowsFrom(q, i);
        if (q < source) before += rows;
        if (q == source) mine = rows;
        total += rows;
      }
      mine = min(mine, s.capacity);
      for (int64_t k = 0; !args.direct && g == 0 && round.index == 0 && k < s.num_chunks; ++k) {
        recv_counts[k] = arrived ? counts.Delivered(source, i, k) : 0;
      }
      shared.a[i] = mine;
      shared.b[i] = before;
      shared.c[i] = total;
    }
    __syncthreads();
    for (int64_t i = 0; i < size; ++i) {
      const int64_t bb = tile + i;
      const int64_t mine = shared.a[i];
      // Packed: the source's rows go after those of the earlier sources, and its zero rows take its share of
      // the zero tail (the shares of all sources tile rows [total, N * C)). Padded: the source's segment.
      V* out = y + (args.packed ? bb * s.num_peers : bb * s.num_peers + source) * segment_units;
      V* data = out + shared.b[i] * units_per_row;
      V* zeros = args.packed ? out + (shared.c[i] + source * s.capacity - shared.b[i]) * units_per_row
                             : data + mine * units_per_row;
      const V* rows = slot + bb * segment_units;
      if constexpr (kPlaced) {  // staged mode: the source's rows onto the rows its place table names, no zeros
        const int32_t* places = args.place + (bb * s.num_peers + source) * s.capacity;
        V* placed_rows = y + bb * args.out_rows * units_per_row;
        ForEachSlice(
            args, arrived ? mine : 0, units_per_row, g,
            [&](int64_t r, int64_t lo, int64_t hi) {
              const int64_t at = places[r];
              if (at < 0 || at >= args.out_rows) return;
              WarpCopy<V, true>(placed_rows + at * units_per_row + lo, rows + r * units_per_row + lo, hi - lo);
            },
            round);
        continue;
      }
      if constexpr (!kInRounds) {  // one pass: every row left to this rank, data rows then zero rows
        const int64_t first = args.direct ? mine : 0;  // direct mode: the source wrote rows [0, mine) itself
        ForEachSlice(args, s.capacity - first, units_per_row, g, [&](int64_t r, int64_t lo, int64_t hi) {
          r += first;
          V* row = r < mine ? data + r * units_per_row : zeros + (r - mine) * units_per_row;
          if (r < mine && arrived) return WarpCopy<V, true>(row + lo, rows + r * units_per_row + lo, hi - lo);
          WarpZero(row + lo, hi - lo);
        });
        continue;
      }
      if (!args.direct) {  // direct mode: the source wrote rows [0, mine) itself
        ForEachSlice(
            args, mine, units_per_row, g,
            [&](int64_t r, int64_t lo, int64_t hi) {
              V* row = data + r * units_per_row;
              if (!arrived) return WarpZero(row + lo, hi - lo);
              WarpCopy<V, true>(row + lo, rows + r * units_per_row + lo, hi - lo);
            },
            round);
      }
      if (round.index == 0) {
        ForEachSlice(args, s.capacity - mine, units_per_row, g,
                     [&](int64_t r, int64_t lo, int64_t hi) { WarpZero(zeros + r * units_per_row + lo, hi - lo); });
      }
    }
    __syncthreads();
  }
}

// The peer that send job `job` (piece job / N) writes to: consecutive jobs serve different peers, job 0 this
// rank's own rows (see the send loop). Receive job j takes what its source's send job j wrote here.
__device__ __forceinline__ int SendPeer(const NvlinkAllToAllvArgs& args, int job) {
  const int num_peers = static_cast<int>(args.shape.num_peers);
  return (args.rank + job % num_peers) % num_peers;
}

// kInRounds: a staged call of one tile whose pieces go in args.rounds rounds (ChooseNvlinkGrid). A variant of
// its own, because the rounds' loop state spills registers of the copy loops, which cost the calls of one
// round 2-4 us (2xH200, T = 16 and 128). kWarpPlan: calls of kMinChunksForWarpPlan chunks per peer or more
// (WarpPlans), whose early plan may take a warp per batch element (PlanTile).
// kPlaced: calls with a place table (args.place), a variant of their own so that the other calls keep their
// registers (the placement pushed every variant to 128 registers and a stack).
template <typename V, bool kInRounds, bool kWarpPlan, bool kPlaced>
__global__ void __launch_bounds__(kThreads) NvlinkAllToAllvKernel(NvlinkAllToAllvArgs args) {
  __shared__ Shared shared;
  const int num_peers = static_cast<int>(args.shape.num_peers);
  const int jobs = num_peers * args.groups;
  const uint64_t epoch = CallEpoch(args.control);
  const uint32_t ticket = TakeTicket(args.control, epoch);
  const int parity = static_cast<int>(epoch & 1);
  const bool direct_packed = args.direct && args.packed;
  const int rounds = kInRounds ? args.rounds : 1;  // SendPiece keeps the tile's plan from its first round
  CallTrace trace(args.control, epoch, args.trace);
  Patience</*kInlineReports=*/true> patience(args.table, args.control, args.rank, num_peers, epoch, kTraceAllToAllv,
                                             args.site, args.timeout_ns);
  if (threadIdx.x == 0) trace.Start();

  if (blockIdx.x == 0) {
    if (direct_packed) ShareCounts(args, shared, parity);
    if (threadIdx.x < num_peers) {
      SymmetricControl* peer = args.table->control[threadIdx.x];
      peer->recv_counts[args.rank] = reinterpret_cast<uint64_t>(args.recv_counts);  // published with `entered`
      peer->place[args.rank] = reinterpret_cast<uint64_t>(args.place);
      if (direct_packed) __threadfence_system();
      PublishOutput(peer, args.rank, args.y, epoch, /*enter=*/true);
    }
  }
  // The plan of a block's first piece needs nothing from its peer except in the direct packed layout (the
  // peers' counts): make it while the peers enter, and wait for the peer's entry in the meantime, so that the
  // wait's round trip overlaps the plan instead of following it. Calls of one tile only, as the MoE exchanges.
  // Its count slot in the peer is free: the peer finished the last call of this parity before it entered the
  // one in between, whose rows this rank has received.
  const bool plan_early = !direct_packed && OneTile(args);
  if (plan_early && static_cast<int>(blockIdx.x) < jobs) {
    const int peer = SendPeer(args, static_cast<int>(blockIdx.x));
    const bool first_piece = static_cast<int>(blockIdx.x) < num_peers;
    const Emit emit = !args.direct                                            ? Emit::kSlot
                      : !kInRounds && first_piece && RecvCountsInShared(args) ? Emit::kShared
                                                                              : Emit::kNone;
    auto await_peer = [&] {
      shared.peer_entered = patience.AtLeastUnaborted(&args.control->entered[peer], epoch, peer);
      trace.PeersEntered();
    };
    PlanTile<kWarpPlan>(args, shared, parity, peer, 0, args.shape.batch, emit, /*dropped=*/first_piece,
                        /*counts_in_shared=*/false, await_peer);
  }
  // Consecutive blocks serve different peers. Blocks of neighbouring indices share parts of the chip, and
  // when each run of them served one peer (or the local copy) the exchange took 16% longer at T = 4096 on
  // 4xH200.
  // Peers rotate by rank so that the ranks start on different links.
  for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
    const int peer = SendPeer(args, job);
    const int g = job / num_peers;
    const bool planned = plan_early && job == static_cast<int>(blockIdx.x);
    bool entered = true;
    if (planned) {
      entered = shared.peer_entered != 0;  // awaited during the plan
    } else if (threadIdx.x == 0) {
      // The direct packed layout places rows after the earlier sources' and zeros after all: every
      // rank's counts are needed, and they come with `entered`.
      for (int q = 0; q < num_peers; ++q) {
        if (q == peer || direct_packed) entered &= patience.AtLeastUnaborted(&args.control->entered[q], epoch, q);
      }
      trace.PeersEntered();
    }
    // A peer that never entered has not published its output address (direct mode): send nothing to it.
    if (__syncthreads_or(!entered)) continue;
    bool zeros_left = false;
    for (int r = 0; r < rounds; ++r) {
      zeros_left = SendPiece<V, kInRounds, kPlaced>(args, shared, parity, peer, g, planned, Round{r, rounds});
      // The block's rows are ordered before each release by SendPiece's final barrier.
      if (threadIdx.x == 0 && r + 1 < rounds) {
        StoreRelease(&args.table->control[peer]->progress[args.rank][g], (epoch << kRoundBits) + r + 1);
      }
    }
    if (threadIdx.x == 0) {
      StoreRelease(&args.table->control[peer]->arrived[args.rank][g], epoch | (zeros_left ? kFlagNote : 0));
      trace.Sent();
    }
  }
  // Receive job j takes piece j / N of source rank - j. In rounds, the blocks that sent this rank's own
  // pieces (job j % N == 0), which end long before those sending to other GPUs, take every source's piece
  // j / N instead, and copy out each round as it lands while later rounds are still on the wire; otherwise
  // the copies out would all start once the last rows had landed. Those blocks send nothing after this, so
  // no sender waits for a receiver.
  for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
    if (rounds > 1 && job % num_peers != 0) continue;
    const int g = job / num_peers;
    const int first_source = (args.rank - job % num_peers + num_peers) % num_peers;
    for (int r = 0; r < rounds; ++r) {
      // Round r of a piece has landed once its progress flag counts r + 1 rounds, the last once it arrived.
      auto landed = [&](int q, uint64_t* seen = nullptr) {
        return r + 1 == rounds
                   ? patience.AtLeast(&args.control->arrived[q][g], epoch, q, seen)
                   : patience.AtLeast(&args.control->progress[q][g], (epoch << kRoundBits) + r + 1, q, seen);
      };
      for (int k = 0; k < (rounds > 1 ? num_peers : 1); ++k) {
        const int source = (first_source - k + num_peers) % num_peers;
        bool arrived = true;
        uint64_t flag = 0;
        if (threadIdx.x == 0) {
          // The counts that place the piece: staged mode, with it (Emit::kSlot; the packed layout needs every
          // source's, which come with their pieces g); the direct packed layout, with `entered`, awaited in the
          // send loop; the direct padded layout, where the source left zero rows, with its piece 0
          // (recv_counts).
          for (int q = 0; args.packed && !args.direct && r == 0 && k == 0 && q < num_peers; ++q) landed(q);
          arrived = landed(source, &flag);
          if (arrived && (flag & kFlagNote) != 0 && !args.packed) {
            arrived = patience.AtLeast(&args.control->arrived[source][0], epoch, source);
          }
          if (r + 1 == rounds) trace.DataArrived();
        }
        arrived = !__syncthreads_or(!arrived);
        const bool zeros_left = __syncthreads_or(arrived && (flag & kFlagNote) != 0);
        // Direct mode: a source that never sent its piece 0 wrote no recv_counts: it delivered nothing.
        if (!arrived && args.direct && g == 0) {
          for (int64_t i = threadIdx.x; i < args.shape.batch * args.shape.num_chunks; i += kThreads) {
            const int64_t b = i / args.shape.num_chunks;
            args.recv_counts[(b * num_peers + source) * args.shape.num_chunks + i % args.shape.num_chunks] = 0;
          }
        }
        if (!args.direct || zeros_left) {
          ReceivePiece<V, kInRounds, kPlaced>(args, shared, parity, source, g, arrived, Round{r, rounds});
        }
      }
    }
  }

  FinishCall(args.control, epoch, ticket, trace, kTraceAllToAllv);
}

bool AlignedTo(int64_t width, const NvlinkAllToAllvArgs& args) {
  auto aligned = [width](const void* p) { return reinterpret_cast<uintptr_t>(p) % width == 0; };
  // In direct mode the peers' outputs are XLA allocations like ours: as aligned as y. Staging areas and
  // their slots are 256-byte aligned.
  return args.shape.row_bytes % width == 0 && args.shape.suffix_bytes % width == 0 && aligned(args.x) &&
         aligned(args.suffix) && aligned(args.y);
}

// Whether a call takes the kernel's kWarpPlan variant. Calls in rounds do not: their pieces are large.
bool WarpPlans(const AllToAllvShape& shape) { return shape.num_chunks >= kMinChunksForWarpPlan; }

template <bool kInRounds, bool kWarpPlan, bool kPlaced>
void Launch(const NvlinkAllToAllvArgs& args, int blocks, cudaStream_t stream) {
  if (AlignedTo(16, args)) {
    NvlinkAllToAllvKernel<uint4, kInRounds, kWarpPlan, kPlaced><<<blocks, kThreads, 0, stream>>>(args);
  } else if (AlignedTo(4, args)) {
    NvlinkAllToAllvKernel<uint32_t, kInRounds, kWarpPlan, kPlaced><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    NvlinkAllToAllvKernel<uint8_t, kInRounds, kWarpPlan, kPlaced><<<blocks, kThreads, 0, stream>>>(args);
  }
}

template <bool kPlaced>
void LaunchVariant(const NvlinkAllToAllvArgs& args, int blocks, cudaStream_t stream) {
  if (args.rounds > 1) {
    Launch<true, false, kPlaced>(args, blocks, stream);
  } else if (WarpPlans(args.shape)) {
    Launch<false, true, kPlaced>(args, blocks, stream);
  } else {
    Launch<false, false, kPlaced>(args, blocks, stream);
  }
}

// Lowers *fewest (0: none yet) to the blocks per SM that each variant of the kernel for units V fits.
template <typename V>
cudaError_t FitVariants(int* fewest) {
  for (const void* kernel : {reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, false, false, false>),
                             reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, false, true, false>),
                             reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, true, false, false>),
                             reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, false, false, true>),
                             reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, false, true, true>),
                             reinterpret_cast<const void*>(NvlinkAllToAllvKernel<V, true, false, true>)}) {
    int fit = 0;
    const cudaError_t status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, kThreads, 0);
    if (status != cudaSuccess) return status;
    *fewest = *fewest == 0 ? fit : std::min(*fewest, fit);
  }
  return cudaSuccess;
}

}  // namespace

NvlinkAllToAllvLayout LayOutNvlinkAllToAllv(const AllToAllvShape& shape, bool direct) {
  auto align = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  NvlinkAllToAllvLayout layout;
  layout.counts_slot_bytes = align(shape.batch * shape.num_peers * shape.num_chunks *
                                   static_cast<int64_t>(sizeof(int32_t)));
  layout.counts_bytes = shape.num_peers * layout.counts_slot_bytes;
  layout.rows_slot_bytes = direct ? 0 : align(shape.batch * shape.capacity * shape.row_bytes);
  layout.staging_bytes = shape.num_peers * layout.rows_slot_bytes;
  return layout;
}

NvlinkGrid ChooseNvlinkGrid(const AllToAllvShape& shape, bool direct, int requested_blocks, int sm_count,
                            int resident_blocks) {
  const int64_t slot_bytes = shape.batch * shape.capacity * shape.row_bytes;
  const int64_t peers = std::max<int64_t>(1, shape.num_peers);
  int64_t blocks = requested_blocks > 0
                       ? requested_blocks
                       : peers * std::clamp<int64_t>((slot_bytes + kMinBytesPerPiece - 1) / kMinBytesPerPiece, 1,
                                                     kMaxPiecesPerPeer);
  // Every block must be resident at once (blocks wait on each other's peers). By size, one per SM: more did
  // not move the rows faster in the block sweeps on 4xH200.
  blocks = std::clamp<int64_t>(blocks, 1, std::max(1, requested_blocks > 0 ? resident_blocks : sm_count));
  NvlinkGrid grid;
  grid.groups = static_cast<int>(std::clamp<int64_t>((blocks + peers - 1) / peers, 1, kMaxPiecesPerPeer));
  grid.blocks = static_cast<int>(blocks);
  const bool one_tile = TileCounts::TileSize(shape) >= shape.batch;
  const int64_t piece_bytes = slot_bytes / grid.groups;
  grid.rounds = direct || !one_tile
                    ? 1
                    : static_cast<int>(std::clamp<int64_t>(piece_bytes / kMinBytesPerRound, 1, kMaxRounds));
  return grid;
}

cudaError_t NvlinkAllToAllvBlocksPerSm(int* blocks) {
  int fewest = 0;
  cudaError_t status = FitVariants<uint4>(&fewest);
  if (status == cudaSuccess) status = FitVariants<uint32_t>(&fewest);
  if (status == cudaSuccess) status = FitVariants<uint8_t>(&fewest);
  if (status == cudaSuccess) *blocks = fewest;
  return status;
}

cudaError_t LaunchNvlinkAllToAllv(const NvlinkAllToAllvArgs& args, int blocks, cudaStream_t stream) {
  if (args.place != nullptr) {
    LaunchVariant<true>(args, blocks, stream);
  } else {
    LaunchVariant<false>(args, blocks, stream);
  }
  return cudaGetLastError();
}

}  // namespace jax_ncclx
