// The CPU collectives' instantiate stage: one CallInstance per custom call of an executable (cpu_collective.h).
#include <atomic>
#include <cstdint>
#include <memory>

#include "common/cpu_collective.h"
#include "common/cpu_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

ffi::TypeId CallInstance::id = {};
const ffi::TypeInfo kCallInstanceTypeInfo = ffi::MakeTypeInfo<CallInstance>();

namespace {

ffi::ErrorOr<std::unique_ptr<CallInstance>> InstantiateImpl(ffi::Dictionary) {
  static std::atomic<int64_t> next_key{1};
  return std::make_unique<CallInstance>(CallInstance{next_key.fetch_add(1, std::memory_order_relaxed)});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuCollectiveInstantiate, InstantiateImpl, ffi::Ffi::BindInstantiate().Attrs());

}  // namespace jax_ncclx
