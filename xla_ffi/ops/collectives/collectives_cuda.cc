// CUDA FFI handlers of the fixed-size collectives: all_reduce, all_gather, reduce_scatter, all_to_all and
// ppermute. Each looks up this device's communicator, checks the buffer sizes against it and queues NCCL
// work on XLA's stream; nothing here waits for the device. Data-moving ops send raw bytes (ncclInt8), so
// every dtype works, fp8 included.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/watchdog.h"
#include "ops/collectives/collective_checks.h"
#include "common/cuda_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

// Starts a call on this device's rank of `comm_id`: the communicator (leased until the handler returns), and
// the call's number and fault.
struct NcclCall {
  CommRank comm;
  GpuCall call;
};

ffi::ErrorOr<NcclCall> BeginNcclCall(std::string_view op, cudaStream_t stream, int32_t device_ordinal, int64_t comm_id,
                                     RawCallAttrs call_attrs) {
  ffi::ErrorOr<CommRank> comm = LookupCommRank(op, comm_id, device_ordinal);
  if (comm.has_error()) return comm.error();
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(op, MakeCallAttrs(call_attrs), comm_id, comm->rank, comm->size,
                                            device_ordinal, stream);
  if (call.has_error()) return call.error();
  return NcclCall{std::move(*comm), *call};
}

// The NCCL type and operation of a reduction of x, and how many values of that type make one element of x.
struct Reduction {
  ncclDataType_t dtype;
  ncclRedOp_t op;
  int64_t per_element;
};

ffi::ErrorOr<Reduction> GetReduction(std::string_view op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                     ReduceOp reduce_op) {
  NCCLX_RETURN_IF_ERROR(CheckSameDtype(op, x, y));
  ffi::ErrorOr<ReducedDtype> reduced = GetReducedDtype(op, x.element_type(), reduce_op);
  if (reduced.has_error()) return reduced.error();
  ffi::ErrorOr<ncclDataType_t> dtype = NcclReductionType(op, reduced->dtype);
  if (dtype.has_error()) return dtype.error();
  return Reduction{*dtype, NcclReduceOp(reduced->op), reduced->per_element};
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, RawCallAttrs call_attrs, ReduceOp reduce_op) {
  constexpr std::string_view kOp = "all_reduce";
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<NcclCall> nccl = BeginNcclCall(kOp, stream, device_ordinal, comm_id, call_attrs);
  if (nccl.has_error()) return nccl.error();
  const CommRank* comm = &nccl->comm;
  ffi::ErrorOr<Reduction> reduction = GetReduction(kOp, x, *y, reduce_op);
  if (reduction.has_error()) return reduction.error();
  NCCLX_RETURN_IF_ERROR(CheckSameBytes(kOp, x, *y));
  if (Bytes(x) == 0) return ffi::Error::Success();
  const size_t count = x.element_count() * reduction->per_element;
  return RunGpuCall(nccl->call, /*watch=*/true, y->untyped_data(), Bytes(*y), [&] {
    return CheckNccl(kOp, "ncclAllReduce",
                     ncclAllReduce(x.untyped_data(), y->untyped_data(), count, reduction->dtype, reduction->op,
                                   comm->comm, stream),
                     comm->comm);
  });
}

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, RawCallAttrs call_attrs) {
  constexpr std::string_view kOp = "all_gather";
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<NcclCall> nccl = BeginNcclCall(kOp, stream, device_ordinal, comm_id, call_attrs);
  if (nccl.has_error()) return nccl.error();
  const CommRank* comm = &nccl->comm;
  NCCLX_RETURN_IF_ERROR(CheckBytes(kOp, "output", Bytes(*y), comm->size * Bytes(x), RanksTimes(comm->size, Bytes(x))));
  if (Bytes(x) == 0) return ffi::Error::Success();
  return RunGpuCall(nccl->call, /*watch=*/true, y->untyped_data(), Bytes(*y), [&] {
    return CheckNccl(kOp, "ncclAllGather",
                     ncclAllGather(x.untyped_data(), y->untyped_data(), Bytes(x), ncclInt8, comm->comm, stream),
                     comm->comm);
  });
}

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm_id, RawCallAttrs call_attrs,
                             ReduceOp reduce_op) {
  constexpr std::string_view kOp = "reduce_scatter";
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<NcclCall> nccl = BeginNcclCall(kOp, stream, device_ordinal, comm_id, call_attrs);
  if (nccl.has_error()) return nccl.error();
  const CommRank* comm = &nccl->comm;
  ffi::ErrorOr<Reduction> reduction = GetReduction(kOp, x, *y, reduce_op);
  if (reduction.has_error()) return reduction.error();
  NCCLX_RETURN_IF_ERROR(CheckBytes(kOp, "input", Bytes(x), comm->size * Bytes(*y), RanksTimes(comm->size, Bytes(*y))));
  if (Bytes(x) == 0) return ffi::Error::Success();
  const size_t count = y->element_count() * reduction->per_element;
  return RunGpuCall(nccl->call, /*watch=*/true, y->untyped_data(), Bytes(*y), [&] {
    return CheckNccl(kOp, "ncclReduceScatter",
                     ncclReduceScatter(x.untyped_data(), y->untyped_data(), count, reduction->dtype, reduction->op,
                                       comm->comm, stream),
                     comm->comm);
  });
}

ffi::Error AllToAllImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        int64_t comm_id, RawCallAttrs call_attrs) {
  constexpr std::string_view kOp = "all_to_all";
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<NcclCall> nccl = BeginNcclCall(kOp, stream, device_ordinal, comm_id, call_attrs);
  if (nccl.has_error()) return nccl.error();
  const CommRank* comm = &nccl->comm;
  NCCLX_RETURN_IF_ERROR(CheckEvenSplit(kOp, Bytes(x), comm->size));
  NCCLX_RETURN_IF_ERROR(CheckSameBytes(kOp, x, *y));
  if (Bytes(x) == 0) return ffi::Error::Success();
  return RunGpuCall(nccl->call, /*watch=*/true, y->untyped_data(), Bytes(*y), [&] {
    return CheckNccl(kOp, "ncclAlltoAll",
                     ncclAlltoAll(x.untyped_data(), y->untyped_data(), Bytes(x) / comm->size, ncclInt8, comm->comm,
                                  stream),
                     comm->comm);
  });
}

ffi::Error PpermuteImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        int64_t comm_id, RawCallAttrs call_attrs, ffi::Span<const int64_t> sources,
                        ffi::Span<const int64_t> targets) {
  constexpr std::string_view kOp = "ppermute";
  NCCLX_RETURN_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<NcclCall> nccl = BeginNcclCall(kOp, stream, device_ordinal, comm_id, call_attrs);
  if (nccl.has_error()) return nccl.error();
  const CommRank* comm = &nccl->comm;
  NCCLX_RETURN_IF_ERROR(CheckPairs(kOp, sources, targets, comm->size));
  NCCLX_RETURN_IF_ERROR(CheckSameBytes(kOp, x, *y));
  const int64_t bytes = Bytes(x);
  if (bytes == 0) return ffi::Error::Success();

  const int64_t source = sources[comm->rank];
  const int64_t target = targets[comm->rank];
  return RunGpuCall(nccl->call, /*watch=*/true, y->untyped_data(), bytes, [&]() -> ffi::Error {
    // CheckPairs makes a rank its own source exactly when it is its own target: a local copy, no NCCL.
    if (source == comm->rank) {
      return CheckCuda(kOp, "cudaMemcpyAsync",
                       cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), bytes, cudaMemcpyDeviceToDevice, stream));
    }
    if (source < 0) {
      NCCLX_RETURN_IF_ERROR(CheckCuda(kOp, "cudaMemsetAsync", cudaMemsetAsync(y->untyped_data(), 0, bytes, stream)));
      if (target < 0) return ffi::Error::Success();
    }
    // Send and receive in one group: with both issued together, rings of ranks cannot deadlock.
    return InNcclGroup(kOp, comm->comm, [&]() -> ffi::Error {
      if (target >= 0) {
        NCCLX_RETURN_IF_ERROR(
            CheckNccl(kOp, "ncclSend",
                      ncclSend(x.untyped_data(), bytes, ncclInt8, static_cast<int>(target), comm->comm, stream),
                      comm->comm));
      }
      if (source < 0) return ffi::Error::Success();
      return CheckNccl(kOp, "ncclRecv",
                       ncclRecv(y->untyped_data(), bytes, ncclInt8, static_cast<int>(source), comm->comm, stream),
                       comm->comm);
    });
  });
}

}  // namespace

// Each handler twice: as is, and (name + Cmdbuf) marked command-buffer compatible, which the lowering takes under
// JAX_NCCLX_NCCL_COMMAND_BUFFERS=1 so that XLA records the NCCL launch into its CUDA graphs; name + CmdbufPrepare is
// the prepare stage of cuda_collective.h, registered with it as the "_watched" target that the lowering takes under
// JAX_NCCLX_WATCH_REPLAYS=1. Replays do not come back to the host: the watchdog times them only through the marks of
// JAX_NCCLX_WATCH_REPLAYS (common/replay_watch.h).
#define NCCLX_DEFINE_NCCL_HANDLER(name, op, impl, binding)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding);                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cmdbuf, impl, binding, {ffi::Traits::kCmdBufferCompatible}); \
  NCCLX_DEFINE_PREPARE_HANDLER(name##CmdbufPrepare, op)

NCCLX_DEFINE_NCCL_HANDLER(NcclAllReduce, "all_reduce", AllReduceImpl, BindCudaCollective().Attr<ReduceOp>("reduce_op"));
NCCLX_DEFINE_NCCL_HANDLER(NcclAllGather, "all_gather", AllGatherImpl,
                          BindCudaCollective());  // y: [N, *x.shape]
NCCLX_DEFINE_NCCL_HANDLER(NcclReduceScatter, "reduce_scatter", ReduceScatterImpl,
                          BindCudaCollective().Attr<ReduceOp>("reduce_op"));  // x: [N, *y.shape]
NCCLX_DEFINE_NCCL_HANDLER(NcclAllToAll, "all_to_all", AllToAllImpl, BindCudaCollective());  // x, y: [N, ...]
NCCLX_DEFINE_NCCL_HANDLER(NcclPpermute, "ppermute", PpermuteImpl,
                          BindCudaCollective()
                              .Attr<ffi::Span<const int64_t>>("sources")    // sources
                              .Attr<ffi::Span<const int64_t>>("targets"));  // targets

}  // namespace jax_ncclx
