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
        nb::list out;
        for (CallRecord& r : TakeCallRecords()) {
          if (resolve) resolve(r);
          nb::dict record;
          record["site"] = r.site;
          record["comm"] = r.comm;
          record["group_index"] = r.group;
          record["seq"] = r.sequence;
          record["rank"] = r.rank;
          record["device"] = r.device;
          record["enqueue_ns"] = r.enqueue_ns;
          record["start_ns"] = r.start_ns;
          record["arrive_ns"] = r.arrive_ns;
          record["end_ns"] = r.end_ns;
          record["injected"] = r.injected;
          out.append(record);
        }
        if (cleared) cleared();
        return out;
      },
      "Takes the traced calls, oldest first, leaving none: dicts of site, comm, group_index, seq, rank, device, "
      "enqueue_ns, start_ns, arrive_ns, end_ns, injected (a FaultKind, or -1).");
}

}  // namespace jax_ncclx
