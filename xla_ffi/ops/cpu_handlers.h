// Declarations of the CPU FFI handler symbols, for the module that registers them.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuPpermute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllToAllvDynamic);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuMoePlanSends);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuMoePlaceReceived);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuTakeRows);

}  // namespace jax_ncclx
