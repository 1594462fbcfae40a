// CUDA handlers of take_rows, expand_rows and encode_rows: decode, check, and launch one kernel
// (take_rows_kernels.cu) on XLA's stream. No host work beyond the launch, so they are safe in command buffers.
#include <cuda_runtime.h>

#include <optional>

#include "common/checks.h"
#include "common/nccl_comms.h"
#include "ops/take_rows/take_rows_checks.h"
#include "ops/take_rows/take_rows_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

ffi::Error TakeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                        std::optional<ffi::AnyBuffer> suffix, ffi::Result<ffi::AnyBuffer> out) {
  ffi::ErrorOr<TakeRowsShape> shape = GetTakeRowsShape(x, index, suffix, *out);
  if (shape.has_error()) return shape.error();
  return CheckCuda(kTakeRowsOp, "kernel launch",
                   LaunchTakeRows(*shape, x.untyped_data(), index.typed_data(), OptionalData(suffix),
                                  out->untyped_data(), stream));
}

ffi::Error ExpandRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                          ffi::Buffer<ffi::S32> sources, ffi::Result<ffi::AnyBuffer> out, MoeWire wire) {
  ffi::ErrorOr<ExpandRowsCall> call = GetExpandRowsCall(x, index, sources, *out, wire);
  if (call.has_error()) return call.error();
  const cudaError_t launched = wire == MoeWire::kNone
                                   ? LaunchExpandRows(call->shape, call->top_k, x.untyped_data(), index.typed_data(),
                                                      sources.typed_data(), out->untyped_data(), stream)
                                   : LaunchExpandWireRows(call->shape, call->top_k, wire, call->token, x.untyped_data(),
                                                          index.typed_data(), sources.typed_data(), out->untyped_data(),
                                                          stream);
  return CheckCuda(kExpandRowsOp, "kernel launch", launched);
}

ffi::Error EncodeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, MoeWire wire) {
  ffi::ErrorOr<EncodeRowsCall> call = GetEncodeRowsCall(x, *out, wire);
  if (call.has_error()) return call.error();
  return CheckCuda(kEncodeRowsOp, "kernel launch",
                   LaunchEncodeRows(call->rows, call->hidden, call->wire, call->token, x.untyped_data(),
                                    out->untyped_data(), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaEncodeRows, EncodeRowsImpl,
                              BindEncodeRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaExpandRows, ExpandRowsImpl,
                              BindExpandRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaTakeRows, TakeRowsImpl,
                              BindTakeRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ncclx
