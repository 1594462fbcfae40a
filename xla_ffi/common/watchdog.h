// How the CUDA handlers keep their promise that no call waits forever, and how they record and perturb calls.
//
//   * NVLink kernels bound their own waits on the device (device_sync.cuh, Patience) and report in a fault
//     record in pinned host memory, which their handlers read before every call (CheckNvlinkFault). The
//     watchdog times them too, from an event after each launch, but only for the late-peer warning below.
//   * NCCL work cannot be bounded from outside, so its handlers record a CUDA event after each call and a
//     watchdog thread checks them: a call that could start (the rank's previous watched call was done) more
//     than its timeout ago and has not finished is declared hung, its communicator is aborted (ncclCommAbort
//     makes the NCCL kernels return) and every later call on it fails with a message naming the call and the
//     local ranks that never reached it. A handler stuck inside NCCL's launch itself (NCCL sets up connections
//     on first use, waiting for the peers on the host) is reported the same way but not aborted. A call still
//     unfinished after its grace (attribute warn_ms, JAX_NCCLX_WARN_AFTER_S), shorter than its timeout, first
//     gets one warning on stderr naming it and the ranks missing, once per call on a communicator. No abort
//     frees a communicator under a handler: a rank whose handler is queueing work on it is stopped when the
//     handler returns (CommLease, nccl_comms.h).
//   * The same bracket applies injected faults (monitor.h) and, under JAX_NCCLX_TRACE=1, records the call
//     with timing events.
// Calls recorded into a CUDA graph (command buffers) get no events: their handler runs once, at capture, and
// replays do not come back to the host. Their NCCL calls are watched through marks in the graph instead
// (replay_watch.h, JAX_NCCLX_WATCH_REPLAYS=1), and their communicators are revoked, not aborted, on a hang.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/symmetric.h"

namespace jax_ncclx {

struct GpuCall {
  std::string_view op;
  CallAttrs attrs;
  int64_t comm_id = 0;
  int rank = 0;
  int size = 0;
  int32_t device = 0;
  cudaStream_t stream = nullptr;
  int64_t sequence = 0;
  std::optional<InjectedFault> fault;
};

// A watched NCCL call as its handler saw it: what the watchdog and the replay watch (replay_watch.h) name
// when it hangs.
struct WatchedCall {
  std::string_view op;  // the handler's kOp, a string literal
  int64_t site = 0;
  int64_t comm_id = 0;
  int rank = 0;
  int size = 0;
  int32_t device = 0;
  int64_t sequence = 0;
  int64_t timeout_ns = 0;
  int64_t warn_ns = 0;  // the late-peer warning's grace (0: none)
};

// Numbers the call and looks up its injected fault; fails with the communicator's recorded fault, if any.
ffi::ErrorOr<GpuCall> BeginGpuCall(std::string_view op, const CallAttrs& attrs, int64_t comm_id, int rank, int size,
                                   int32_t device, cudaStream_t stream);

// An NVLink handler's check of its rank's fault record: DeadlineExceeded naming the call that gave up and the
// ranks it waited for, once the kernels of the communicator gave up waiting.
ffi::Error CheckNvlinkFault(std::string_view op, int64_t comm_id, const SymmetricRank& symmetric);

// Records every local NVLink fault record as its communicator's fault (RecordCommFault), so that NCCL calls
// on it fail too. The watchdog does this every few milliseconds.
void RecordNvlinkFaults();

// What OpenCall set up for CloseCall.
struct CallBracket {
  bool skip = false;  // an injected kSkip fault: do nothing
  CallRecord record;
  uint64_t watch_id = 0;  // the watchdog's entry, registered before the launch (0: none)
  bool watch_replays = false;  // a captured NCCL call to watch in replays (replay_watch.h)
};

ffi::ErrorOr<CallBracket> OpenCall(const GpuCall& call, bool watch);
// `launched`: what the launch returned; on failure the watchdog's entry is dropped and the error returned.
ffi::Error CloseCall(const GpuCall& call, CallBracket& bracket, ffi::Error launched, void* output,
                     int64_t output_bytes);

// Queues a call's work (`launch()`, returning ffi::Error) inside its bracket. `watch`: NCCL work, which the
// watchdog must time. `output`: where an injected kCorruptPayload fault overwrites 4 bytes.
template <typename Launch>
ffi::Error RunGpuCall(const GpuCall& call, bool watch, void* output, int64_t output_bytes, Launch launch) {
  ffi::ErrorOr<CallBracket> bracket = OpenCall(call, watch);
  if (bracket.has_error()) return bracket.error();
  if (bracket->skip) return ffi::Error::Success();
  return CloseCall(call, *bracket, launch(), output, output_bytes);
}

// What the watchdog knows that other processes need to name a missing rank (jax_ncclx/_src/comm.py asks
// them through JAX's key-value store): the highest call each local rank queued on each communicator, and the
// hung calls whose missing ranks are in other processes.
struct WatchdogState {
  std::vector<std::tuple<int64_t, int, int64_t>> reached;  // (comm_id, rank, sequence)
  std::vector<std::pair<int64_t, int64_t>> unnamed;        // (comm_id, sequence of the hung call)
  // (comm_id, sequence, description) of each communicator's latest call that finished only after half its
  // timeout: within a host a peer's abort ends this rank's NCCL kernel early without any NCCL error.
  std::vector<std::tuple<int64_t, int64_t, std::string>> late;
};
WatchdogState GetWatchdogState();

// Runs one watchdog pass now, on the calling thread (check_errors: so that a call that just finished is seen).
void WatchNow();

// Starts the watchdog thread if it is not running (it also reports NVLink faults as soon as they happen).
void StartWatchdog();
// Stops and joins it (at interpreter exit, before CUDA goes away).
void StopWatchdog();
// Forgets every communicator's watched calls and progress (destroy_all, after StopWatchdog): comm ids are
// never reused, so their entries would only pile up across re-inits.
void ForgetWatchedCalls();

// Fills a traced record's start_ns / end_ns from its CUDA events and releases them (0 where an event has not
// completed). For the trace bindings.
void ResolveCallRecord(CallRecord& record);
// Forgets the per-device clock anchors (after the trace was read and cleared), so that the next traced calls
// measure from a fresh one: cudaEventElapsedTime's float milliseconds lose precision over long spans.
void ResetTraceAnchors();

}  // namespace jax_ncclx
