// CUDA FFI handlers of the small-message NVLink collectives: all_reduce (one-shot or two-shot), all_gather,
// all_to_all and reduce_scatter (one-shot). Each checks its buffers as the NCCL handler of the op does, finds this rank's symmetric
// memory, and queues one kernel (nvlink_collectives_kernels.cu) on XLA's stream. The kernel's arguments are fixed for
// the program (peer addresses come from the stable peer table, epochs live on the device), so the handlers are safe
// inside command buffers; their prepare stage (cuda_collective.h, registered under JAX_NCCLX_WATCH_REPLAYS=1) refuses
// an execution on a communicator that failed, since replays never call them. The Python lowering picks the algorithm by
// size and sizes the symmetric memory before the program can run.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/symmetric.h"
#include "common/watchdog.h"
#include "ops/collectives/collective_checks.h"
#include "common/cuda_collective.h"
#include "ops/collectives/nvlink_collectives_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

ffi::ErrorOr<ReduceType> GetReduceType(std::string_view op, ffi::DataType dtype) {
  switch (dtype) {
    case ffi::F32:
      return ReduceType::kF32;
    case ffi::BF16:
      return ReduceType::kBF16;
    case ffi::F16:
      return ReduceType::kF16;
    case ffi::S32:
      return ReduceType::kS32;
    default: {
      std::string supported;
      for (const Named& type : kReduceTypeNames) supported += std::string(supported.empty() ? "" : ", ") + type.name;
      return InvalidArgument(op, "the NVLink kernel cannot reduce dtype " + std::string(DataTypeName(dtype)) +
                                     "; supported: " + supported + " (others take the NCCL path)");
    }
  }
}

ffi::ErrorOr<NvlinkProtocol> GetProtocol(std::string_view op, NvlinkProtocol protocol) {
  if (!ValidNvlinkProtocol(protocol)) {
    return InvalidArgument(op, "protocol is " + std::to_string(static_cast<int>(protocol)) +
                                   ", expected 0 (LL128), 1 (LL) or 2 (simple)");
  }
  return protocol;
}

// The fields every op's call fills in the same way.
ffi::ErrorOr<NvlinkCollectiveArgs> ArgsFor(std::string_view name, NvlinkCollective op, const ffi::AnyBuffer& x,
                                           ffi::AnyBuffer& y, const CallAttrs& call, const SymmetricRank& symmetric,
                                           NvlinkProtocol protocol, bool direct) {
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(name, "x", x.element_type()));
  ffi::ErrorOr<NvlinkProtocol> chosen = GetProtocol(name, protocol);
  if (chosen.has_error()) return chosen.error();
  if (direct && !symmetric.same_process) {
    return InvalidArgument(name, "direct is true but the communicator's ranks are not all in this process");
  }
  NvlinkCollectiveArgs args;
  args.direct = direct;
  args.op = op;
  args.protocol = *chosen;
  args.element_bytes = static_cast<int>(ffi::ByteWidth(x.element_type()));
  args.bytes = Bytes(x);
  args.trace = call.trace_device;
  args.site = call.site;
  args.timeout_ns = static_cast<uint64_t>(call.timeout_ms) * 1000000;
  args.x = x.untyped_data();
  args.y = y.untyped_data();
  return args;
}

// ArgsFor, plus the reduction and the element type it reduces (a complex number's parts, see GetReducedDtype).
ffi::ErrorOr<NvlinkCollectiveArgs> ReductionArgsFor(std::string_view name, NvlinkCollective op, const ffi::AnyBuffer& x,
                                                    ffi::AnyBuffer& y, const CallAttrs& call,
                                                    const SymmetricRank& symmetric, NvlinkProtocol protocol,
                                                    bool direct, ReduceOp reduce_op) {
  ffi::ErrorOr<ReducedDtype> reduced = GetReducedDtype(name, x.element_type(), reduce_op);
  if (reduced.has_error()) return reduced.error();
  ffi::ErrorOr<ReduceType> type = GetReduceType(name, reduced->dtype);
  if (type.has_error()) return type.error();
  ffi::ErrorOr<NvlinkCollectiveArgs> args = ArgsFor(name, op, x, y, call, symmetric, protocol, direct);
  if (args.has_error()) return args.error();
  args->reduce = reduced->op;
  args->reduce_type = *type;
  args->element_bytes = static_cast<int>(ffi::ByteWidth(reduced->dtype));
  return args;
}

// The checks and launch every handler shares once it has filled in the op-specific fields of `args`.
ffi::Error Launch(std::string_view op, cudaStream_t stream, int32_t device_ordinal, int64_t comm_id,
                  const SymmetricRank& symmetric, const CallAttrs& attrs, NvlinkCollectiveArgs args, int64_t blocks) {
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(op, comm_id, symmetric));
  args.rank = symmetric.rank;
  args.size = symmetric.size;
  args.table = symmetric.table;
  args.control = symmetric.control;
  if (args.bytes == 0) return ffi::Error::Success();
  NCCLX_RETURN_IF_ERROR(CheckSlots(op,
                                   NvlinkCollectiveSlotBytes(args.op, args.algorithm, args.protocol, args.bytes,
                                                             args.size, args.element_bytes, args.direct),
                                   symmetric));
  ffi::ErrorOr<int> sm_count = SmCount(op, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  const int grid = ChooseNvlinkCollectiveBlocks(args, RequestedBlocks(blocks), *sm_count);
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(op, attrs, comm_id, symmetric.rank, symmetric.size, device_ordinal, stream);
  if (call.has_error()) return call.error();
  const int64_t output_bytes = args.op == NvlinkCollective::kAllGather       ? args.bytes * args.size
                               : args.op == NvlinkCollective::kReduceScatter ? args.bytes / args.size
                                                                             : args.bytes;
  return RunGpuCall(*call, /*watch=*/false, args.y, output_bytes, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(op, stream));
    return CheckCuda(op, "NVLink kernel launch", LaunchNvlinkCollective(args, grid, stream));
  });
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, RawCallAttrs call_attrs, ReduceOp reduce_op, NvlinkAlgorithm algorithm,
                         NvlinkProtocol protocol, int64_t blocks, bool direct) {
  const CallAttrs call = MakeCallAttrs(call_attrs);
  constexpr std::string_view kOp = "all_reduce";
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  NCCLX_RETURN_IF_ERROR(CheckSameDtype(kOp, x, *y));
  NCCLX_RETURN_IF_ERROR(CheckSameBytes(kOp, x, *y));
  if (!ValidNvlinkAlgorithm(algorithm)) {
    return InvalidArgument(kOp, "algorithm is " + std::to_string(static_cast<int>(algorithm)) +
                                    ", expected 1 (one-shot) or 2 (two-shot)");
  }
  ffi::ErrorOr<NvlinkCollectiveArgs> args = ReductionArgsFor(kOp, NvlinkCollective::kAllReduce, x, *y, call, *symmetric,
                                                             protocol, direct, reduce_op);
  if (args.has_error()) return args.error();
  args->algorithm = algorithm;
  return Launch(kOp, stream, device_ordinal, comm_id, *symmetric, call, *args, blocks);
}

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm_id, RawCallAttrs call_attrs,
                             ReduceOp reduce_op, NvlinkProtocol protocol, int64_t blocks) {
  constexpr std::string_view kOp = "reduce_scatter";
  const CallAttrs call = MakeCallAttrs(call_attrs);
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  NCCLX_RETURN_IF_ERROR(CheckSameDtype(kOp, x, *y));
  NCCLX_RETURN_IF_ERROR(CheckEvenSplit(kOp, Bytes(x), symmetric->size));
  NCCLX_RETURN_IF_ERROR(
      CheckBytes(kOp, "output", Bytes(*y), Bytes(x) / symmetric->size,
                 "the input's " + std::to_string(Bytes(x)) + " over " + std::to_string(symmetric->size) + " ranks"));
  // Nothing to write into a peer's output: the blocks a rank reduces must sit in its slots.
  ffi::ErrorOr<NvlinkCollectiveArgs> args = ReductionArgsFor(kOp, NvlinkCollective::kReduceScatter, x, *y, call,
                                                             *symmetric, protocol, /*direct=*/false, reduce_op);
  if (args.has_error()) return args.error();
  return Launch(kOp, stream, device_ordinal, comm_id, *symmetric, call, *args, blocks);
}

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, RawCallAttrs call_attrs, NvlinkProtocol protocol, int64_t blocks,
                         bool direct) {
  constexpr std::string_view kOp = "all_gather";
  const CallAttrs call = MakeCallAttrs(call_attrs);
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  NCCLX_RETURN_IF_ERROR(
      CheckBytes(kOp, "output", Bytes(*y), symmetric->size * Bytes(x), RanksTimes(symmetric->size, Bytes(x))));
  ffi::ErrorOr<NvlinkCollectiveArgs> args = ArgsFor(kOp, NvlinkCollective::kAllGather, x, *y, call, *symmetric,
                                                    protocol, direct);
  if (args.has_error()) return args.error();
  return Launch(kOp, stream, device_ordinal, comm_id, *symmetric, call, *args, blocks);
}

ffi::Error AllToAllImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        int64_t comm_id, RawCallAttrs call_attrs, NvlinkProtocol protocol, int64_t blocks,
                        bool direct) {
  constexpr std::string_view kOp = "all_to_all";
  const CallAttrs call = MakeCallAttrs(call_attrs);
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  NCCLX_RETURN_IF_ERROR(CheckEvenSplit(kOp, Bytes(x), symmetric->size));
  NCCLX_RETURN_IF_ERROR(CheckSameBytes(kOp, x, *y));
  ffi::ErrorOr<NvlinkCollectiveArgs> args = ArgsFor(kOp, NvlinkCollective::kAllToAll, x, *y, call, *symmetric, protocol,
                                                    direct);
  if (args.has_error()) return args.error();
  return Launch(kOp, stream, device_ordinal, comm_id, *symmetric, call, *args, blocks);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkAllReduce, AllReduceImpl,
                              BindCudaCollective()
                                  .Attr<ReduceOp>("reduce_op")  // 0 sum, 1 max, 2 min
                                  .Attr<NvlinkAlgorithm>("algorithm")  // 1 one-shot, 2 two-shot
                                  .Attr<NvlinkProtocol>("protocol")  // 0 LL128, 1 LL, 2 simple (one-shot)
                                  .Attr<int64_t>("blocks")  // 0 = by size
                                  .Attr<bool>("direct"),  // write into the peers' outputs where it can
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvlinkAllGather, AllGatherImpl,
    BindCudaCollective().Attr<NvlinkProtocol>("protocol").Attr<int64_t>("blocks").Attr<bool>("direct"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkReduceScatter, ReduceScatterImpl,
                              BindCudaCollective()
                                  .Attr<ReduceOp>("reduce_op")  // 0 sum (the only one the Python op sends)
                                  .Attr<NvlinkProtocol>("protocol")
                                  .Attr<int64_t>("blocks"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvlinkAllToAll, AllToAllImpl,
    BindCudaCollective().Attr<NvlinkProtocol>("protocol").Attr<int64_t>("blocks").Attr<bool>("direct"),
    {ffi::Traits::kCmdBufferCompatible});

NCCLX_DEFINE_PREPARE_HANDLER(NvlinkAllReducePrepare, "all_reduce");
NCCLX_DEFINE_PREPARE_HANDLER(NvlinkAllGatherPrepare, "all_gather");
NCCLX_DEFINE_PREPARE_HANDLER(NvlinkAllToAllPrepare, "all_to_all");
NCCLX_DEFINE_PREPARE_HANDLER(NvlinkReduceScatterPrepare, "reduce_scatter");

}  // namespace jax_ncclx
