// The FFI binding prefix every single-operand CUDA collective handler shares (NCCL and NVLink): stream,
// device, x, y, comm_id and the call attributes of monitor.h; the op's own attributes follow.
#pragma once

#include <cuda_runtime.h>

#include "common/monitor.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

inline auto BindCudaCollective() {
  return BindCallAttrs(xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                           .Ctx<xla::ffi::DeviceOrdinal>()                 // device_ordinal
                           .Arg<xla::ffi::AnyBuffer>()                     // x
                           .Ret<xla::ffi::AnyBuffer>()                     // y
                           .Attr<int64_t>("comm_id"));                     // comm_id
}

}  // namespace jax_ncclx
