// CUDA FFI handlers of all_to_allv_dynamic: every rank sends a data-dependent number of rows (counts, on
// the device) to each peer, at most `capacity` rows per peer. All the work is queued on XLA's stream and
// sized by the static capacity, so the host never reads the counts. Two transports:
//   NCCL (portable):  plan kernel -> pack kernel (zero-padded send buffer) -> one NCCL group of
//                     all-to-alls (rows and recv_counts) -> compact kernel (packed layout only);
//   NVLink:           one kernel writing straight into the peers' symmetric memory
//                     (all_to_allv_nvlink_kernels.cu); command-buffer compatible.
// The optional send_rows [B, S] name the row of x that each send row takes, and the optional suffix [B, S, G]
// is appended to each send row; both transports gather through them as they copy rows out (the pack kernel,
// the NVLink kernel; SourceRow in all_to_allv_plan.h).
// ragged_all_to_all's exchange is the same call with a place table [B, N * C]: the received rows land on the
// rows of its output that the table names (the NVLink kernel writes them there; the NCCL path receives into
// its workspace and places them with one kernel), and the output's other rows keep their values.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/symmetric.h"
#include "common/watchdog.h"
#include "ops/all_to_allv/all_to_allv_checks.h"
#include "ops/all_to_allv/all_to_allv_kernels.h"
#include "common/cuda_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

// Checks the operands against each other and the communicator size, and returns the kernels' sizes.
// Placed calls also check `place` against y and set *out_rows to y's rows per batch element.
ffi::ErrorOr<AllToAllvShape> GetShape(std::string_view op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& counts,
                                      const std::optional<ffi::Buffer<ffi::S32>>& send_rows,
                                      const std::optional<ffi::AnyBuffer>& suffix,
                                      const std::optional<ffi::Buffer<ffi::S32>>& place, const ffi::AnyBuffer& y,
                                      const ffi::Buffer<ffi::S32>& recv_counts, const ffi::Buffer<ffi::S32>& dropped,
                                      int num_ranks, int64_t capacity, int64_t* out_rows) {
  ffi::ErrorOr<AllToAllvSendRows> rows = GetSendRows(op, x, send_rows, suffix);
  if (rows.has_error()) return rows.error();
  ffi::ErrorOr<int64_t> num_chunks = CheckReceiveSide(op, *rows, x, counts.dimensions(), y, recv_counts.dimensions(),
                                                      dropped.dimensions(), num_ranks, capacity, place.has_value());
  if (num_chunks.has_error()) return num_chunks.error();
  *out_rows = 0;
  if (place.has_value()) {
    ffi::ErrorOr<int64_t> placed_rows = CheckPlace(op, *rows, place->dimensions(), y, num_ranks, capacity);
    if (placed_rows.has_error()) return placed_rows.error();
    *out_rows = *placed_rows;
  }
  AllToAllvShape shape;
  shape.batch = rows->batch;
  shape.source_rows = rows->source_rows;
  shape.num_rows = rows->num_rows;
  shape.row_bytes = rows->row_bytes;
  shape.suffix_bytes = rows->suffix_bytes;
  shape.num_peers = num_ranks;
  shape.num_chunks = *num_chunks;
  shape.capacity = capacity;
  return shape;
}

int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Byte offsets of the workspace pieces, each 256-byte aligned, in this order.
struct WorkspaceLayout {
  int64_t send = 0;              // [B, N, C, row_bytes] padded rows to send
  int64_t recv = 0;              // [B, N, C, row_bytes] padded rows received (packed and placed only)
  int64_t delivered_chunks = 0;  // int32 [B, N, K] rows of each chunk sent (the peers' recv_counts)
  int64_t first_row = 0;         // int64 [B, N] input row where each peer's rows start
  int64_t delivered = 0;         // int64 [B, N] rows sent to each peer
  int64_t total = 0;
};

// `received_apart`: the packed layout and placed calls, whose rows NCCL cannot receive where they end up.
WorkspaceLayout LayOutWorkspace(const AllToAllvShape& shape, bool received_apart) {
  const int64_t exchange_bytes = shape.batch * shape.num_peers * shape.capacity * shape.row_bytes;
  const int64_t pairs = shape.batch * shape.num_peers;
  int64_t offset = 0;
  auto take = [&offset](int64_t bytes) {
    const int64_t start = offset;
    offset += Align256(bytes);
    return start;
  };
  WorkspaceLayout layout;
  layout.send = take(exchange_bytes);
  layout.recv = take(received_apart ? exchange_bytes : 0);
  layout.delivered_chunks = take(pairs * shape.num_chunks * static_cast<int64_t>(sizeof(int32_t)));
  layout.first_row = take(pairs * static_cast<int64_t>(sizeof(int64_t)));
  layout.delivered = take(pairs * static_cast<int64_t>(sizeof(int64_t)));
  layout.total = offset;
  return layout;
}

// The counts a call sends: `counts` itself, or, under an injected kCorruptCounts fault, a corrupted copy in
// stream-ordered memory that ReleaseCounts frees after the call's work.
ffi::ErrorOr<const int32_t*> CountsToSend(std::string_view op, const GpuCall& call,
                                          const ffi::Buffer<ffi::S32>& counts) {
  if (!call.fault || call.fault->kind != FaultKind::kCorruptCounts || counts.element_count() == 0) {
    return counts.typed_data();
  }
  void* corrupted = nullptr;
  NCCLX_RETURN_IF_ERROR(
      CheckCuda(op, "cudaMallocAsync", cudaMallocAsync(&corrupted, counts.size_bytes(), call.stream)));
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "corrupt counts kernel launch",
                                  LaunchCorruptCounts(counts.typed_data(), static_cast<int32_t*>(corrupted),
                                                      counts.element_count(), call.stream)));
  return static_cast<const int32_t*>(corrupted);
}

ffi::Error ReleaseCounts(std::string_view op, const GpuCall& call, const ffi::Buffer<ffi::S32>& counts,
                         const int32_t* sent) {
  if (sent == counts.typed_data()) return ffi::Error::Success();
  return CheckCuda(op, "cudaFreeAsync", cudaFreeAsync(const_cast<int32_t*>(sent), call.stream));
}

// NvlinkAllToAllvBlocksPerSm, asked once: every GPU of a process runs the same kernels (the lent machines and
// the clusters this targets have one GPU model per host).
ffi::ErrorOr<int> KernelBlocksPerSm() {
  static std::atomic<int> known{0};
  return AskOnce(known, []() -> ffi::ErrorOr<int> {
    int per_sm = 0;
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(kAllToAllvOp, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", NvlinkAllToAllvBlocksPerSm(&per_sm)));
    if (per_sm < 1) return Internal(kAllToAllvOp, "the NVLink kernel fits no block on an SM of this GPU");
    return per_sm;
  });
}

// The arguments both transports' handlers start with.
auto BindAllToAllv() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
      .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
      .Arg<ffi::AnyBuffer>()                     // x: [B, X, F...]
      .Arg<ffi::Buffer<ffi::S32>>()              // counts: [B, N, K]
      .OptionalArg<ffi::Buffer<ffi::S32>>()      // send_rows: [B, S], the row of x each send row takes
      .OptionalArg<ffi::AnyBuffer>()             // suffix: [B, S, G], appended to each send row
      .Ret<ffi::AnyBuffer>()                     // y: [B, N, C, F... (+ G)] / [B, N*C, F... (+ G)]
      .Ret<ffi::Buffer<ffi::S32>>()              // recv_counts: [B, N, K]
      .Ret<ffi::Buffer<ffi::S32>>();             // dropped: [B, N]
}

ffi::Error NcclImpl(std::string_view op, cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::S32> counts, std::optional<ffi::Buffer<ffi::S32>> send_rows,
                    std::optional<ffi::AnyBuffer> suffix, std::optional<ffi::Buffer<ffi::S32>> place,
                    ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::S32> recv_counts,
                    ffi::ResultBuffer<ffi::S32> dropped, ffi::ResultBuffer<ffi::U8> workspace, int64_t comm_id,
                    RawCallAttrs call_attrs, ExchangeAttrs exchange) {
  ffi::ErrorOr<CommRank> comm = LookupCommRank(op, comm_id, device_ordinal);
  if (comm.has_error()) return comm.error();
  int64_t out_rows = 0;
  ffi::ErrorOr<AllToAllvShape> shape = GetShape(op, x, counts, send_rows, suffix, place, *y, *recv_counts, *dropped,
                                                comm->size, exchange.capacity, &out_rows);
  if (shape.has_error()) return shape.error();
  const bool received_apart = exchange.packed || place.has_value();
  const WorkspaceLayout layout = LayOutWorkspace(*shape, received_apart);
  NCCLX_RETURN_IF_ERROR(CheckDims(op, "workspace", workspace->dimensions(), {layout.total}));
  if (shape->batch == 0) return ffi::Error::Success();

  uint8_t* base = workspace->typed_data();
  uint8_t* send = base + layout.send;
  // The padded layout is exactly NCCL's receive layout, so rows land in y directly.
  uint8_t* recv = received_apart ? base + layout.recv : static_cast<uint8_t*>(y->untyped_data());
  int32_t* delivered_chunks = reinterpret_cast<int32_t*>(base + layout.delivered_chunks);
  int64_t* first_row = reinterpret_cast<int64_t*>(base + layout.first_row);
  int64_t* delivered = reinterpret_cast<int64_t*>(base + layout.delivered);

  ffi::ErrorOr<GpuCall> call = BeginGpuCall(op, MakeCallAttrs(call_attrs), comm_id, comm->rank, comm->size,
                                            device_ordinal, stream);
  if (call.has_error()) return call.error();
  const int64_t peer_bytes = shape->capacity * shape->row_bytes;
  const int64_t batch_bytes = shape->num_peers * peer_bytes;
  const int64_t batch_counts = shape->num_peers * shape->num_chunks;
  return RunGpuCall(*call, /*watch=*/true, y->untyped_data(), y->size_bytes(), [&]() -> ffi::Error {
    ffi::ErrorOr<const int32_t*> send_counts = CountsToSend(op, *call, counts);
    if (send_counts.has_error()) return send_counts.error();
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "plan kernel launch",
                                    LaunchPlanSends(*shape, *send_counts, delivered_chunks, first_row, delivered,
                                                    dropped->typed_data(), stream)));
    NCCLX_RETURN_IF_ERROR(ReleaseCounts(op, *call, counts, *send_counts));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "pack kernel launch",
                                    LaunchPackRows(*shape, x.untyped_data(), OptionalData(send_rows),
                                                   OptionalData(suffix), first_row, delivered, send, stream)));
    NCCLX_RETURN_IF_ERROR(InNcclGroup(op, comm->comm, [&]() -> ffi::Error {
      for (int64_t b = 0; b < shape->batch; ++b) {
        if (peer_bytes > 0) {
          NCCLX_RETURN_IF_ERROR(CheckNccl(op, "ncclAlltoAll (rows)",
                                          ncclAlltoAll(send + b * batch_bytes, recv + b * batch_bytes, peer_bytes,
                                                       ncclInt8, comm->comm, stream),
                                          comm->comm));
        }
        if (shape->num_chunks > 0) {
          NCCLX_RETURN_IF_ERROR(
              CheckNccl(op, "ncclAlltoAll (recv_counts)",
                        ncclAlltoAll(delivered_chunks + b * batch_counts, recv_counts->typed_data() + b * batch_counts,
                                     shape->num_chunks, ncclInt32, comm->comm, stream),
                        comm->comm));
        }
      }
      return ffi::Error::Success();
    }));
    if (place.has_value()) {
      return CheckCuda(op, "place kernel launch",
                       LaunchPlaceRows(*shape, recv, recv_counts->typed_data(), place->typed_data(), out_rows,
                                       y->untyped_data(), stream));
    }
    if (!exchange.packed) return ffi::Error::Success();
    return CheckCuda(op, "compact kernel launch",
                     LaunchCompactRows(*shape, recv, recv_counts->typed_data(), y->untyped_data(), stream));
  });
}

ffi::Error NvlinkImpl(std::string_view op, cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                      ffi::Buffer<ffi::S32> counts, std::optional<ffi::Buffer<ffi::S32>> send_rows,
                      std::optional<ffi::AnyBuffer> suffix, std::optional<ffi::Buffer<ffi::S32>> place,
                      ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::S32> recv_counts,
                      ffi::ResultBuffer<ffi::S32> dropped, int64_t comm_id, RawCallAttrs call_attrs,
                      ExchangeAttrs exchange, int64_t blocks, bool direct) {
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(op, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(op, comm_id, *symmetric));
  int64_t out_rows = 0;
  ffi::ErrorOr<AllToAllvShape> shape = GetShape(op, x, counts, send_rows, suffix, place, *y, *recv_counts, *dropped,
                                                symmetric->size, exchange.capacity, &out_rows);
  if (shape.has_error()) return shape.error();
  if (direct && !symmetric->same_process) {
    return InvalidArgument(op, "direct is true but the communicator's ranks are not all in this process");
  }
  const NvlinkAllToAllvLayout layout = LayOutNvlinkAllToAllv(*shape, direct);
  if (layout.staging_bytes > symmetric->staging_bytes || layout.counts_bytes > symmetric->parity_half_bytes) {
    return Internal(op, "the symmetric memory holds " + std::to_string(symmetric->staging_bytes) +
                            " staging bytes and " + std::to_string(symmetric->parity_half_bytes) +
                            " low-latency bytes per parity, but this call needs " +
                            std::to_string(layout.staging_bytes) + " and " + std::to_string(layout.counts_bytes) +
                            "; they are sized when the program is lowered by jax_ncclx");
  }
  if (shape->batch == 0) return ffi::Error::Success();
  ffi::ErrorOr<int> sm_count = SmCount(op, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  ffi::ErrorOr<int> per_sm = KernelBlocksPerSm();
  if (per_sm.has_error()) return per_sm.error();
  const NvlinkGrid grid = ChooseNvlinkGrid(*shape, direct, RequestedBlocks(blocks), *sm_count, *sm_count * *per_sm);

  const CallAttrs attrs = MakeCallAttrs(call_attrs);
  NvlinkAllToAllvArgs args;
  args.shape = *shape;
  args.rank = symmetric->rank;
  args.groups = grid.groups;
  args.rounds = grid.rounds;
  args.packed = exchange.packed;
  args.direct = direct;
  args.trace = attrs.trace_device;
  args.site = attrs.site;
  args.timeout_ns = static_cast<uint64_t>(attrs.timeout_ms) * 1000000;
  args.x = x.untyped_data();
  args.send_rows = OptionalData(send_rows);
  args.suffix = OptionalData(suffix);
  args.y = y->untyped_data();
  args.place = OptionalData(place);
  args.out_rows = out_rows;
  args.recv_counts = recv_counts->typed_data();
  args.dropped = dropped->typed_data();
  args.table = symmetric->table;
  args.control = symmetric->control;
  args.counts_slot_bytes = layout.counts_slot_bytes;
  args.rows_slot_bytes = layout.rows_slot_bytes;
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(op, attrs, comm_id, symmetric->rank, symmetric->size, device_ordinal,
                                            stream);
  if (call.has_error()) return call.error();
  return RunGpuCall(*call, /*watch=*/false, y->untyped_data(), y->size_bytes(), [&]() -> ffi::Error {
    ffi::ErrorOr<const int32_t*> send_counts = CountsToSend(op, *call, counts);
    if (send_counts.has_error()) return send_counts.error();
    args.counts = *send_counts;
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(op, stream));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "NVLink kernel launch", LaunchNvlinkAllToAllv(args, grid.blocks, stream)));
    return ReleaseCounts(op, *call, counts, *send_counts);
  });
}

ffi::Error NcclAllToAllvDynamicImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::S32> counts, std::optional<ffi::Buffer<ffi::S32>> send_rows,
                                    std::optional<ffi::AnyBuffer> suffix, ffi::Result<ffi::AnyBuffer> y,
                                    ffi::ResultBuffer<ffi::S32> recv_counts, ffi::ResultBuffer<ffi::S32> dropped,
                                    ffi::ResultBuffer<ffi::U8> workspace, int64_t comm_id, RawCallAttrs call_attrs,
                                    ExchangeAttrs exchange) {
  return NcclImpl(kAllToAllvOp, stream, device_ordinal, x, counts, send_rows, suffix, std::nullopt, y, recv_counts,
                  dropped, workspace, comm_id, call_attrs, exchange);
}

ffi::Error NvlinkAllToAllvDynamicImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                                      ffi::Buffer<ffi::S32> counts, std::optional<ffi::Buffer<ffi::S32>> send_rows,
                                      std::optional<ffi::AnyBuffer> suffix, ffi::Result<ffi::AnyBuffer> y,
                                      ffi::ResultBuffer<ffi::S32> recv_counts, ffi::ResultBuffer<ffi::S32> dropped,
                                      int64_t comm_id, RawCallAttrs call_attrs, ExchangeAttrs exchange, int64_t blocks,
                                      bool direct) {
  return NvlinkImpl(kAllToAllvOp, stream, device_ordinal, x, counts, send_rows, suffix, std::nullopt, y, recv_counts,
                    dropped, comm_id, call_attrs, exchange, blocks, direct);
}

// ragged_all_to_all's exchange: `output` is y's buffer (XLA aliases them), so the rows nothing places keep
// its values.
ffi::Error NcclRaggedAllToAllImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                                  ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> send_rows,
                                  ffi::Buffer<ffi::S32> place, ffi::AnyBuffer /*output*/, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::ResultBuffer<ffi::S32> recv_counts, ffi::ResultBuffer<ffi::S32> dropped,
                                  ffi::ResultBuffer<ffi::U8> workspace, int64_t comm_id, RawCallAttrs call_attrs,
                                  int64_t capacity) {
  return NcclImpl(kRaggedAllToAllOp, stream, device_ordinal, x, counts, send_rows, std::nullopt, place, y, recv_counts,
                  dropped, workspace, comm_id, call_attrs, ExchangeAttrs{capacity, /*packed=*/false});
}

ffi::Error NvlinkRaggedAllToAllImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> send_rows,
                                    ffi::Buffer<ffi::S32> place, ffi::AnyBuffer /*output*/,
                                    ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::S32> recv_counts,
                                    ffi::ResultBuffer<ffi::S32> dropped, int64_t comm_id, RawCallAttrs call_attrs,
                                    int64_t capacity, int64_t blocks, bool direct) {
  return NvlinkImpl(kRaggedAllToAllOp, stream, device_ordinal, x, counts, send_rows, std::nullopt, place, y,
                    recv_counts, dropped, comm_id, call_attrs, ExchangeAttrs{capacity, /*packed=*/false}, blocks,
                    direct);
}

// The arguments of ragged_all_to_all's exchange on both transports.
auto BindRaggedAllToAll() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
      .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
      .Arg<ffi::AnyBuffer>()                     // x: [B, X, F...]
      .Arg<ffi::Buffer<ffi::S32>>()              // counts: [B, N, K]
      .Arg<ffi::Buffer<ffi::S32>>()              // send_rows: [B, S], the row of x each send row takes
      .Arg<ffi::Buffer<ffi::S32>>()              // place: [B, N * C], the row of y each received row lands on
      .Arg<ffi::AnyBuffer>()                     // output: [B, O, F...], y's buffer
      .Ret<ffi::AnyBuffer>()                     // y: [B, O, F...]
      .Ret<ffi::Buffer<ffi::S32>>()              // recv_counts: [B, N, K]
      .Ret<ffi::Buffer<ffi::S32>>();             // dropped: [B, N]
}

}  // namespace

int64_t NcclAllToAllvWorkspaceBytes(const AllToAllvShape& shape, bool received_apart) {
  return LayOutWorkspace(shape, received_apart).total;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NcclRaggedAllToAll, NcclRaggedAllToAllImpl,
                              BindCallAttrs(BindRaggedAllToAll()
                                                .Ret<ffi::Buffer<ffi::U8>>()  // workspace: [W]
                                                .Attr<int64_t>("comm_id"))     // comm_id
                                  .Attr<int64_t>("capacity"));               // capacity

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkRaggedAllToAll, NvlinkRaggedAllToAllImpl,
                              BindCallAttrs(BindRaggedAllToAll().Attr<int64_t>("comm_id"))  // comm_id
                                  .Attr<int64_t>("capacity")                 // capacity
                                  .Attr<int64_t>("blocks")                   // blocks (0 = chosen by size)
                                  .Attr<bool>("direct"),  // direct: write into the peers' outputs
                              {ffi::Traits::kCmdBufferCompatible});
NCCLX_DEFINE_PREPARE_HANDLER(NvlinkRaggedAllToAllPrepare, "ragged_all_to_all");

XLA_FFI_DEFINE_HANDLER_SYMBOL(NcclAllToAllvDynamic, NcclAllToAllvDynamicImpl,
                              BindCallAttrs(BindAllToAllv()
                                                .Ret<ffi::Buffer<ffi::U8>>()  // workspace: [W]
                                                .Attr<int64_t>("comm_id"))  // comm_id
                                  .Attr<ExchangeAttrs>("exchange"));

// Safe in command buffers: one kernel launch whose arguments are fixed for the program (peer addresses are
// read from the stable peer table, epochs live on the device).
XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkAllToAllvDynamic, NvlinkAllToAllvDynamicImpl,
                              BindCallAttrs(BindAllToAllv().Attr<int64_t>("comm_id"))  // comm_id
                                  .Attr<ExchangeAttrs>("exchange")
                                  .Attr<int64_t>("blocks")  // blocks (0 = chosen by size)
                                  .Attr<bool>("direct"),    // direct: write into the peers' outputs
                              {ffi::Traits::kCmdBufferCompatible});
// Under JAX_NCCLX_WATCH_REPLAYS=1: replays never call the handler, so this refuses a failed communicator's.
NCCLX_DEFINE_PREPARE_HANDLER(NvlinkAllToAllvDynamicPrepare, "all_to_allv_dynamic");

}  // namespace jax_ncclx
