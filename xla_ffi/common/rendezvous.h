// In-process meeting point for the CPU collectives. XLA:CPU runs every virtual device of a process on a thread
// of its own and may run a program's independent operations concurrently, in an order that differs from one
// device to the next. So a participant never blocks a thread while it waits for its peers: it publishes
// pointers to its operands and the work that writes its outputs, and its handler returns a pending
// ffi::Future. The last participant to arrive runs every participant's work (each reads the peers' operands
// in place) and then completes the others' futures. Two calls entered in opposite orders on two devices thus
// both complete, and so does a mix of these calls and XLA's own (blocking) collectives.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
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

// One participant's share of the work: writes its outputs from every participant's published pointers
// (indexed by rank). It runs on whichever thread arrives last, after the handler has returned, so it must own
// what it captures (values and raw buffer pointers, never references to the handler's locals). It runs
// once: with every participant's pointers, or with none when the round failed (to record the failure; its
// result is then ignored).
using CollectiveWork = std::function<ffi::Error(const std::vector<Published>&)>;

// Joins one collective as `rank` of `size`, publishing `mine`. Returns a future that completes once every
// participant's work has run, with this participant's work's error if any. A peer that does not arrive
// within `timeout` (0: wait forever) fails every participant that did with an error naming the call
// (`what`) and the ranks that are missing; a participant arriving after that fails at once. A round still
// short of peers `warn_after` after its first participant arrived (0: never; only when shorter than the
// timeout) prints one warning to stderr naming the call and the ranks still missing, and keeps waiting.
ffi::Future JoinCollective(std::string_view op, std::string what, const RoundKey& key, int64_t rank, int64_t size,
                           Published mine, std::chrono::milliseconds timeout, std::chrono::milliseconds warn_after,
                           CollectiveWork work);

// A future that is already complete with `error` (success or not), for a handler that returns before it
// joins a collective.
ffi::Future CompletedFuture(ffi::Error error);

}  // namespace jax_ncclx
