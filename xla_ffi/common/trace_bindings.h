// A device trace record (symmetric_layout.h) as the Python dict that trace.device_trace() and the loopback
// module give, named field by field in one place.
#pragma once

#include <nanobind/nanobind.h>

#include "common/symmetric_layout.h"

namespace jax_ncclx {

inline nanobind::dict TraceRecordDict(const DeviceTraceRecord& r) {
  nanobind::dict record;
  record["epoch"] = r.epoch;
  record["start_ns"] = r.start_ns;
  record["peers_ns"] = r.peers_ns;
  record["ready_ns"] = r.ready_ns;
  record["sent_ns"] = r.sent_ns;
  record["data_ns"] = r.data_ns;
  record["end_ns"] = r.end_ns;
  record["blocks"] = r.blocks;
  record["kernel"] = r.kernel;
  return record;
}

}  // namespace jax_ncclx
