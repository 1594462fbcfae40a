// The always-built extension module: FFI capsules of the CPU handlers, and what this build contains.
#include <nanobind/nanobind.h>

#include "common/contract_bindings.h"
#include "common/monitor_bindings.h"
#include "common/cpu_handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::capsule DataCapsule(const void* data) { return nb::capsule(const_cast<void*>(data)); }

}  // namespace

NB_MODULE(_ncclx_cpu, m) {
  jax_ncclx::DefineContractBindings(m);
  m.def(
      "types",
      [] {
        nb::dict types;
        nb::dict call_instance;
        call_instance["type_id"] = DataCapsule(&jax_ncclx::CallInstance::id);
        call_instance["type_info"] = DataCapsule(&jax_ncclx::kCallInstanceTypeInfo);
        types["jax_ncclx.CallInstance"] = call_instance;
        return types;
      },
      "FFI state types of the CPU handlers, to register before the handlers.");
  m.def(
      "registrations",
      [] {
        nb::dict targets;
        // The collectives meet their peers per instruction: an instantiate stage gives each one its key.
        const auto collective = [](auto* execute) {
          nb::dict stages;
          stages["instantiate"] = Capsule(jax_ncclx::CpuCollectiveInstantiate);
          stages["execute"] = Capsule(execute);
          return stages;
        };
        targets["ncclx_all_reduce"] = collective(jax_ncclx::CpuAllReduce);
        targets["ncclx_all_gather"] = collective(jax_ncclx::CpuAllGather);
        targets["ncclx_reduce_scatter"] = collective(jax_ncclx::CpuReduceScatter);
        targets["ncclx_all_to_all"] = collective(jax_ncclx::CpuAllToAll);
        targets["ncclx_ppermute"] = collective(jax_ncclx::CpuPpermute);
        targets["ncclx_all_to_allv_dynamic"] = collective(jax_ncclx::CpuAllToAllvDynamic);
        targets["ncclx_ragged_all_to_all"] = collective(jax_ncclx::CpuRaggedAllToAll);
        targets["ncclx_moe_plan_sends"] = Capsule(jax_ncclx::CpuMoePlanSends);
        targets["ncclx_moe_place_received"] = Capsule(jax_ncclx::CpuMoePlaceReceived);
        targets["ncclx_take_rows"] = Capsule(jax_ncclx::CpuTakeRows);
        targets["ncclx_expand_rows"] = Capsule(jax_ncclx::CpuExpandRows);
        targets["ncclx_encode_rows"] = Capsule(jax_ncclx::CpuEncodeRows);
        return targets;
      },
      "FFI handler capsules of the CPU backend, by target name (a dict of stages for the collectives).");
  m.def(
      "ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
      "XLA FFI API version of the headers this module was compiled against.");
  jax_ncclx::DefineMonitorBindings(m, nullptr, nullptr);
}
