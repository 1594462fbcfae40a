// The FFI binding prefix every single-operand CUDA collective handler shares (NCCL and NVLink): stream,
// device, x, y, comm_id and the call attributes of monitor.h; the op's own attributes follow. And the prepare
// stage of every handler that XLA may record into a command buffer.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "common/contract_attrs.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
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

// An NVLink handler's `blocks` attribute as the grid choosers take it: 0 (or below) picks by size, and a
// request is capped by them anyway, so one past int's range is capped here rather than truncated.
inline int RequestedBlocks(int64_t blocks) { return static_cast<int>(std::min<int64_t>(blocks, 1 << 30)); }

// Before every execution, replays included (XLA runs the prepare stage of a custom call even when it only
// replays the graph it captured): a communicator that failed (the replay watch found an NCCL call hung, an
// NVLink kernel gave up waiting and the watchdog recorded it) fails the execution with its reason instead of
// letting replays go on with undefined outputs. XLA builds a call frame for it in every execution, before the
// program launches: 0.6 us of host time per call in a program of 200 on one H100 (docs/performance.md).
inline xla::ffi::Error CheckCommBeforeExecution(std::string_view op, xla::ffi::Dictionary attrs) {
  xla::ffi::ErrorOr<int64_t> comm_id = attrs.get<int64_t>("comm_id");
  if (comm_id.has_error()) return comm_id.error();
  return CheckCommUsable(op, *comm_id);
}

// Defines `name`, the prepare stage above for the handlers of `op`.
#define NCCLX_DEFINE_PREPARE_HANDLER(name, op)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                           \
      name, [](::xla::ffi::Dictionary attrs) { return ::jax_ncclx::CheckCommBeforeExecution(op, attrs); }, \
      ::xla::ffi::Ffi::BindPrepare().Attrs())

}  // namespace jax_ncclx
