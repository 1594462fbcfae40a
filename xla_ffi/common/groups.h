// Where a participant stands in the replica groups of a collective: the groups arrive as one flat attribute
// of partition ids (num_groups * group_size values), exactly as the Python lowering computed them.
#pragma once

#include <cstdint>

#include "common/checks.h"

namespace jax_ncclx {

struct GroupPosition {
  int64_t group_idx = -1;  // which group this participant belongs to
  int64_t rank = -1;       // its position (axis index) inside that group
};

inline ffi::ErrorOr<GroupPosition> FindGroupPosition(std::string_view op, ffi::Span<const int64_t> groups,
                                                     int64_t group_size, int64_t partition_id) {
  if (group_size <= 0 || groups.size() % group_size != 0) {
    return InvalidArgument(op, "groups attribute is not a whole number of groups of group_size " +
                                   std::to_string(group_size));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i] == partition_id) {
      return GroupPosition{static_cast<int64_t>(i) / group_size, static_cast<int64_t>(i) % group_size};
    }
  }
  return InvalidArgument(op, "partition " + std::to_string(partition_id) + " is in none of the replica groups");
}

}  // namespace jax_ncclx
