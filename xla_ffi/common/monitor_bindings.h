// The Python bindings of monitor.h, defined the same way in both extension modules (each links its own copy
// of the tables): name_call_site, restart_sequences, set_faults and call_records.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "common/monitor.h"

namespace jax_ncclx {

// `resolve` fills a record's device times from its CUDA events (and releases them) before it is returned;
// `cleared` runs after the records were taken (the ring is then empty).
inline void DefineMonitorBindings(nanobind::module_& m, std::function<void(CallRecord&)> resolve,
                                  std::function<void()> cleared) {
  namespace nb = nanobind;
  m.def("name_call_site", &NameCallSite, nb::arg("site"), nb::arg("axis"),
        "Names the axis of a call site, for error messages.");
  m.def("restart_sequences", &RestartSequences, "Starts every communicator's call numbers at 0 again.");
  m.def(
      "set_faults",
      [](const std::vector<std::tuple<int, int, int64_t, int64_t>>& specs) {
        std::vector<InjectedFault> faults;
        for (const auto& [kind, rank, sequence, delay_ms] : specs) {
          faults.push_back(InjectedFault{static_cast<FaultKind>(kind), rank, sequence, delay_ms});
        }
        SetInjectedFaults(std::move(faults));
      },
      nb::arg("faults"), "Faults to inject: (kind, rank, sequence, delay_ms) tuples; [] turns injection off.");
  m.def(
      "call_records",
      [resolve, cleared]() {
        std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int64_t, int64_t, int64_t, int64_t,
                               int32_t>>
            out;
        for (CallRecord& r : TakeCallRecords()) {
          if (resolve) resolve(r);
          out.emplace_back(r.site, r.comm, r.group, r.sequence, r.rank, r.device, r.enqueue_ns, r.start_ns, r.arrive_ns,
                           r.end_ns, r.injected);
        }
        if (cleared) cleared();
        return out;
      },
      "Takes the traced calls, oldest first, leaving none: (site, comm, group, sequence, rank, device, "
      "enqueue_ns, start_ns, arrive_ns, end_ns, injected).");
}

}  // namespace jax_ncclx
