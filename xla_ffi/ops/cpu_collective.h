// What every CPU collective handler shares: the replica-group attributes the Python lowering passes to each
// CPU custom call, and the call that turns them into a rendezvous with the right peers.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string_view>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/groups.h"
#include "common/rendezvous.h"

namespace jax_ncclx {

// Appends the attributes every CPU collective takes, in the order the handlers' last parameters expect.
template <typename Binding>
auto BindCpuGroupAttrs(Binding binding) {
  return std::move(binding).template Attr<ffi::Span<const int64_t>>("groups")  // flat partition ids of all groups
      .template Attr<int64_t>("group_size")                          // participants per group (axis size)
      .template Attr<int64_t>("op_id")                               // unique id of the call site
      .template Attr<int64_t>("timeout_ms");                         // how long to wait for peers
}

// Runs `body(rank, peers)` as participant `partition_id` of its replica group.
inline ffi::Error RunInGroup(std::string_view op, uint32_t partition_id, ffi::Span<const int64_t> groups,
                             int64_t group_size, int64_t op_id, int64_t timeout_ms, Published mine,
                             const std::function<void(int64_t, const std::vector<Published>&)>& body) {
  ffi::ErrorOr<GroupPosition> position = FindGroupPosition(op, groups, group_size, partition_id);
  if (position.has_error()) return position.error();
  const RoundKey key{op_id, position->group_idx, NextSequence(op_id, partition_id)};
  const int64_t rank = position->rank;
  return RunCollective(op, key, rank, group_size, mine, std::chrono::milliseconds(timeout_ms),
                       [&](const std::vector<Published>& peers) { body(rank, peers); });
}

}  // namespace jax_ncclx
