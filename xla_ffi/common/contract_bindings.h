// contract(): the tables of contract.h as a Python dict, defined by both native modules.
#pragma once

#include <nanobind/nanobind.h>

#include "common/contract.h"

namespace jax_ncclx {

inline void DefineContractBindings(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "contract",
      [] {
        auto table = [](const auto& names) {
          nb::dict values;
          for (const Named& named : names) values[named.name] = named.value;
          return values;
        };
        nb::dict contract;
        contract["fault_kinds"] = table(kFaultKindNames);
        contract["reduce_ops"] = table(kReduceOpNames);
        contract["nvlink_algorithms"] = table(kNvlinkAlgorithmNames);
        contract["nvlink_protocols"] = table(kNvlinkProtocolNames);
        contract["moe_wires"] = table(kMoeWireNames);
        contract["float_types"] = table(kFloatTypeNames);
        contract["reduce_types"] = table(kReduceTypeNames);
        contract["trace_kernels"] = table(kTraceKernelNames);
        contract["max_nvlink_ranks"] = kMaxNvlinkRanks;
        contract["max_capacity"] = kMaxCapacity;
        contract["max_experts"] = kMaxRoutingExperts;
        contract["moe_wire_block"] = kMoeWireBlock;
        return contract;
      },
      "What the Python half and the handlers agree on (xla_ffi/common/contract.h): {table: {name: value}} for\n"
      "fault_kinds, reduce_ops, nvlink_algorithms, nvlink_protocols, moe_wires, float_types, reduce_types and\n"
      "trace_kernels; and the limits and sizes max_nvlink_ranks, max_capacity, max_experts, moe_wire_block.");
}

}  // namespace jax_ncclx
