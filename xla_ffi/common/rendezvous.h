// In-process meeting point for the CPU collectives. XLA:CPU runs every virtual device of a process on a thread
// of its own, so the participants of one collective are threads of this process: each publishes pointers to
// its operands, waits until every peer has, reads what it needs straight from the peers' buffers, and waits
// once more so that no operand is released while a peer may still be reading it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "common/checks.h"

namespace jax_ncclx {

// What one participant shares with its peers for the duration of a collective.
struct Published {
  const void* data = nullptr;   // the operand
  const void* extra = nullptr;  // op-specific side data (e.g. the all_to_allv send plan)
};

// Identifies one collective instance: the call site (op_id, unique per lowering), the replica group it runs
// in, the logical execution (XLA's run id, the same on every device of one execution of a program), and how
// many times this call site has run before in that execution (a call site inside a loop runs many times).
// Keyed by execution, a call that some participant never made (a skipped rank, a failed peer) leaves the
// next execution's calls unaffected.
struct RoundKey {
  int64_t op_id;
  int64_t group_idx;
  int64_t run_id;
  int64_t sequence;
  bool operator<(const RoundKey& other) const;
};

// Returns how many times participant `partition_id` has entered call site `op_id` before in execution
// `run_id` (0, 1, 2, ...). A device runs one execution of a program at a time, so only the latest is kept.
int64_t RendezvousSequence(int64_t op_id, int64_t partition_id, int64_t run_id);

// Runs one collective: publishes `mine` as `rank` of `size`, waits for all peers, calls `body` with every
// participant's published pointers (indexed by rank), then waits until all peers have finished their body.
// A peer that does not arrive within `timeout` makes every waiting participant fail with an error that
// names the call (`what`) and the ranks that are missing. Once all have arrived, none leaves before every
// body has finished, however long that takes: its operands must outlive the peers' reads.
ffi::Error RunCollective(std::string_view op, std::string_view what, const RoundKey& key, int64_t rank, int64_t size,
                         Published mine, std::chrono::milliseconds timeout,
                         const std::function<void(const std::vector<Published>&)>& body);

}  // namespace jax_ncclx
