// Declarations of the CPU FFI handler symbols, for the module that registers them.
#pragma once

#include "xla/ffi/api/ffi.h"

#include "common/cpu_collective.h"

namespace jax_ncclx {

// The instantiate stage of every CPU collective (the six below CpuPpermute included), and the type of the
// state it makes, which the module registers with XLA before the handlers.
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuCollectiveInstantiate);
extern const ffi::TypeInfo kCallInstanceTypeInfo;

XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuPpermute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllToAllvDynamic);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuRaggedAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuMoePlanSends);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuMoePlaceReceived);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuTakeRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuExpandRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuEncodeRows);

}  // namespace jax_ncclx
