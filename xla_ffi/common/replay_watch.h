// Watching NCCL calls that XLA replays from CUDA graphs (command buffers, JAX_NCCLX_WATCH_REPLAYS=1).
//
// A captured call's handler runs once, at capture; replays never come back to the host. So the handler
// leaves two marks in the graph after each watched call:
//   * an external event record (cudaEventRecordExternal). Its event turns NotReady when a replay that holds it
//     is enqueued and Success when the latest such replay gets past it. With replays queued back to back it
//     can stay NotReady however fast they run, so it says only that a replay is on its way;
//   * a one-thread kernel that counts the replays that got past the call and stamps the device clock, in
//     pinned host memory that the watchdog reads without a CUDA call (replay_watch_kernels.h).
// A rank's captured calls on a communicator are hung when one of them has been on its way for its timeout
// while none of them got past (no count moved). The hung call is the first one on its way after the call
// that got past last (the device clock orders them; capture order stands for program order); the missing
// local ranks are those that neither got past it as often nor wait in it too. The kernel costs a graph node
// per call, hence opt-in; the event record cost nothing measurable in a graph of 200 calls.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/watchdog.h"

namespace jax_ncclx {

// Whether handlers that capture NCCL calls add the marks above (set from JAX_NCCLX_WATCH_REPLAYS at lowering,
// read at capture).
void SetWatchReplays(bool watch);
bool WatchReplays();

// Adds the marks after the call's work on `stream` (capturing) and starts watching it. Past a bound on
// watched calls it says so once on stderr and adds nothing.
ffi::Error WatchCapturedCall(const WatchedCall& call, cudaStream_t stream);

// One pass over the watched replays (the watchdog's): (comm_id, message) for each communicator with a hung
// call, whose message names the call and the local ranks that never reached it.
std::vector<std::pair<int64_t, std::string>> FindHungReplays();

// Forgets every watched call (destroy_all). Their events and marks are kept, not reused: a graph that still
// holds them may be replayed.
void ForgetCapturedCalls();

}  // namespace jax_ncclx
