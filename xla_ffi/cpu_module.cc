// The always-built extension module: FFI capsules of the CPU handlers, and what this build contains.
#include <nanobind/nanobind.h>

#include "common/monitor_bindings.h"
#include "ops/cpu_handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ncclx_cpu, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["ncclx_all_reduce"] = Capsule(jax_ncclx::CpuAllReduce);
    targets["ncclx_all_gather"] = Capsule(jax_ncclx::CpuAllGather);
    targets["ncclx_reduce_scatter"] = Capsule(jax_ncclx::CpuReduceScatter);
    targets["ncclx_all_to_all"] = Capsule(jax_ncclx::CpuAllToAll);
    targets["ncclx_ppermute"] = Capsule(jax_ncclx::CpuPpermute);
    targets["ncclx_all_to_allv_dynamic"] = Capsule(jax_ncclx::CpuAllToAllvDynamic);
    targets["ncclx_moe_plan_sends"] = Capsule(jax_ncclx::CpuMoePlanSends);
    targets["ncclx_moe_place_received"] = Capsule(jax_ncclx::CpuMoePlaceReceived);
    targets["ncclx_take_rows"] = Capsule(jax_ncclx::CpuTakeRows);
    return targets;
  }, "FFI handler capsules of the CPU backend, by target name.");
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "XLA FFI API version of the headers this module was compiled against.");
  jax_ncclx::DefineMonitorBindings(m, nullptr, nullptr);
}
