// The call bracket and the watchdog thread declared in watchdog.h.
#include "common/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/nccl_comms.h"
#include "common/replay_watch.h"
#include "common/replay_watch_kernels.h"

namespace jax_ncclx {
namespace {

std::string KernelName(uint32_t kernel) {
  switch (kernel) {
    case kTraceAllToAllv:
      return "all_to_allv_dynamic";
    case kTraceAllReduce:
      return "all_reduce";
    case kTraceAllGather:
      return "all_gather";
    case kTraceAllToAll:
      return "all_to_all";
    case kTraceReduceScatter:
      return "reduce_scatter";
    case kTraceMoeCombine:
      return "moe.combine";
    case kTraceMoeDispatch:
      return "moe.dispatch";
    case kTraceMoeMaskedDispatch:
      return "moe.masked_dispatch";
    case kTraceMoeMaskedCombine:
      return "moe.masked_combine";
  }
  return "kernel " + std::to_string(kernel);
}

// One message for every local rank's fault record of `comm_id`: the calls that gave up and whom they waited
// for, or, when only aborted ranks are local, who aborted them.
std::string NvlinkFaultMessage(int64_t comm_id, const std::vector<NvlinkFaultReport>& reports) {
  const NvlinkFaultReport* first_gave_up = nullptr;
  const NvlinkFaultReport* first_aborted = nullptr;
  for (const NvlinkFaultReport& report : reports) {
    if (report.comm_id != comm_id) continue;
    if (report.fault.state == kNvlinkGaveUp && first_gave_up == nullptr) first_gave_up = &report;
    if (report.fault.state == kNvlinkAborted && first_aborted == nullptr) first_aborted = &report;
  }
  // Ranks that gave up name whom they waited for; aborted ranks carry the list of the rank that aborted them.
  const uint32_t named_by = first_gave_up != nullptr ? kNvlinkGaveUp : kNvlinkAborted;
  std::set<int> missing;
  for (const NvlinkFaultReport& report : reports) {
    if (report.comm_id != comm_id || report.fault.state != named_by) continue;
    for (int r = 0; r < kMaxNvlinkRanks; ++r) {
      if (report.fault.missing[r]) missing.insert(r);
    }
  }
  const NvlinkFaultReport* shown = first_gave_up != nullptr ? first_gave_up : first_aborted;
  if (shown == nullptr) return "";
  const NvlinkFault& f = shown->fault;
  std::string message = "NVLink call #" + std::to_string(f.epoch) + " on communicator " + std::to_string(comm_id) +
                        " (" + KernelName(f.kernel) + ", " + DescribeCallSite(f.site) + ") ";
  if (first_gave_up != nullptr) {
    message += "timed out after " + DescribeSeconds(f.waited_ns) + " (" + std::string(kTimeoutSettings) +
               "): rank(s) " + RankList(missing) + " of " + std::to_string(shown->size) +
               " did not arrive (seen by rank " + std::to_string(shown->rank) + "); the communicator is aborted";
  } else {
    message += "was aborted on rank " + std::to_string(shown->rank) + " of " + std::to_string(shown->size) +
               " because rank " + std::to_string(static_cast<int>(f.aborted_by) - 1) + " timed out waiting for " +
               (missing.empty() ? std::string("a peer (that rank's error names the missing ranks)")
                                : "rank(s) " + RankList(missing));
  }
  return message;
}

// ---- events ---------------------------------------------------------------------------------------------

std::mutex events_mu;
std::map<std::pair<int32_t, bool>, std::vector<cudaEvent_t>> free_events;  // (device, timing) -> events
std::map<cudaEvent_t, std::pair<int32_t, bool>> event_kinds;

ffi::ErrorOr<cudaEvent_t> TakeEvent(std::string_view op, int32_t device, bool timing) {
  {
    std::lock_guard<std::mutex> lock(events_mu);
    std::vector<cudaEvent_t>& pool = free_events[{device, timing}];
    if (!pool.empty()) {
      cudaEvent_t event = pool.back();
      pool.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;  // the handler's device is current
  const unsigned flags = timing ? cudaEventDefault : cudaEventDisableTiming;
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&event, flags)));
  std::lock_guard<std::mutex> lock(events_mu);
  event_kinds[event] = {device, timing};
  return event;
}

void ReturnEvent(cudaEvent_t event) {
  if (event == nullptr) return;
  std::lock_guard<std::mutex> lock(events_mu);
  free_events[event_kinds[event]].push_back(event);
}

// Per device: an event recorded on an idle stream and the host time right after it completed. Device times
// of traced calls are offsets from it (cudaEventElapsedTime), converted to the host clock.
struct Anchor {
  cudaEvent_t event = nullptr;
  int64_t host_ns = 0;
};
std::mutex anchors_mu;
std::map<int32_t, Anchor> anchors;

ffi::Error EnsureAnchor(std::string_view op, int32_t device) {
  std::lock_guard<std::mutex> lock(anchors_mu);
  if (anchors.count(device)) return ffi::Error::Success();
  Anchor anchor;
  cudaStream_t idle = nullptr;
  NCCLX_RETURN_IF_ERROR(
      CheckCuda(op, "cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&idle, cudaStreamNonBlocking)));
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaEventCreate", cudaEventCreate(&anchor.event)));
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaEventRecord", cudaEventRecord(anchor.event, idle)));
  NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaEventSynchronize", cudaEventSynchronize(anchor.event)));
  anchor.host_ns = NowNs();
  cudaStreamDestroy(idle);
  anchors[device] = anchor;
  return ffi::Error::Success();
}

// ---- the watchdog ----------------------------------------------------------------------------------------

struct Watched {
  WatchedCall call;
  uint64_t id = 0;
  int64_t opened_ns = 0;      // the handler began queueing the call
  cudaEvent_t end = nullptr;  // recorded after the call's work; null while the handler is inside NCCL's launch
  int64_t started_ns = 0;     // when the watchdog saw the rank's previous watched call done (see WatchOnce)
  bool reported = false;      // a launch that never returned was reported
  bool warn_only = false;     // an NVLink call: its kernels bound their own wait, so it only gets the warning
};

struct Watchdog {
  std::mutex mu;
  std::condition_variable wake;
  std::deque<Watched> pending;
  uint64_t next_id = 1;
  std::map<std::pair<int64_t, int>, int64_t> reached;  // (comm_id, rank) -> highest sequence queued
  std::map<int64_t, int64_t> unnamed;  // comm_id -> hung call whose missing ranks are in other processes
  std::map<int64_t, Watched> last_done;  // comm_id -> its most recent call seen done (event returned)
  std::map<int64_t, std::pair<int64_t, std::string>> late;  // comm_id -> (sequence, description) of its
                                                             // latest call done after half its timeout
  std::map<int64_t, int64_t> warned;  // comm_id -> the latest call of it that got its late-peer warning
  bool running = false;
  bool stop = false;
  std::thread* thread = nullptr;  // never destroyed: joined by StopWatchdog
};

Watchdog& GetWatchdog() {
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

WatchedCall DescribeWatchedCall(const GpuCall& call) {
  WatchedCall watched{call.op, call.attrs.site, call.comm_id, call.rank, call.size, call.device, call.sequence};
  watched.timeout_ns = call.attrs.timeout_ms * 1000000;
  watched.warn_ns = call.attrs.warn_ms * 1000000;
  return watched;
}

// "call #7 on communicator 3 (all_reduce, axis 'x', call site 2)", for messages.
std::string DescribeCall(const WatchedCall& call) {
  return "call #" + std::to_string(call.sequence) + " on communicator " + std::to_string(call.comm_id) + " (" +
         std::string(call.op) + ", " + DescribeCallSite(call.site) + ")";
}

constexpr auto kPollInterval = std::chrono::milliseconds(20);

// Who is missing from `call`, as far as this process can tell: the local ranks of its communicator that never
// queued it, or that every local rank did (`*elsewhere` set when the communicator has ranks in other
// processes, among which the missing ones then are). `completed`: "did not complete" or "has not completed".
std::string MissingFrom(Watchdog& w, const WatchedCall& call, const std::string& completed, bool* elsewhere,
                        bool nvlink = false) {
  std::set<int> never, local;
  ffi::ErrorOr<std::map<int32_t, CommMember>> members = CommMembers("watchdog", call.comm_id);
  if (members.has_value()) {
    for (const auto& [device, member] : *members) {
      local.insert(member.rank);
      const auto reached = w.reached.find({call.comm_id, member.rank});
      if (reached == w.reached.end() || reached->second < call.sequence) never.insert(member.rank);
    }
  }
  *elsewhere = false;
  if (!never.empty()) return "rank(s) " + RankList(never) + " never reached it";
  if (static_cast<int>(local.size()) < call.size) {
    *elsewhere = true;
    return "every rank in this process (" + RankList(local) +
           ") reached it; the missing rank(s) are among those in other processes (NCCL does not say which)";
  }
  return std::string("every rank reached it, but ") + (nvlink ? "the NVLink kernel " : "NCCL ") + completed + " it";
}

// The message for `hung`, a call that did not finish in time or (`nccl_error` set) that NCCL ended early
// because a peer aborted or died: which local ranks of its communicator never queued that call.
std::string HangMessage(Watchdog& w, const WatchedCall& hung, const std::string& nccl_error = "") {
  std::string message = DescribeCall(hung) + " " +
                        (nccl_error.empty()
                             ? "has not finished " + DescribeSeconds(hung.timeout_ns) + " after it could start"
                             : "was ended by NCCL (" + nccl_error + ": a peer aborted or died)") +
                        " on rank " + std::to_string(hung.rank) + " of " + std::to_string(hung.size) +
                        (nccl_error.empty() ? " (" + std::string(kTimeoutSettings) + "): " : ": ");
  bool elsewhere = false;
  message += MissingFrom(w, hung, "did not complete", &elsewhere);
  if (elsewhere) w.unnamed.emplace(hung.comm_id, hung.sequence);
  return message + "; the communicator is aborted";
}

// The late-peer warning of `call`, unfinished `waited_ns` after it could start (`queueing`: its handler is
// still inside NCCL's launch), or "" when none is due: past its grace, before its timeout, and once per call
// on a communicator however many local ranks wait in it. Called with w.mu held.
std::string LateWarning(Watchdog& w, const WatchedCall& call, int64_t waited_ns, bool queueing, bool nvlink = false) {
  if (call.warn_ns <= 0 || call.warn_ns >= call.timeout_ns || waited_ns <= call.warn_ns) return "";
  int64_t& warned = w.warned.try_emplace(call.comm_id, -1).first->second;
  if (warned >= call.sequence) return "";
  warned = call.sequence;
  bool elsewhere = false;
  return DescribeCall(call) + " " +
         (queueing ? "is still being queued by NCCL (connection set-up waits for the peers) " : "has not finished ") +
         DescribeSeconds(call.warn_ns) + " after it could start on rank " + std::to_string(call.rank) + " of " +
         std::to_string(call.size) + ": " + MissingFrom(w, call, "has not completed", &elsewhere, nvlink) +
         "; still waiting, until the timeout of " + DescribeSeconds(call.timeout_ns) + " (" +
         std::string(kTimeoutSettings) + "; JAX_NCCLX_WARN_AFTER_S sets when this is printed)";
}

// One pass over the watched calls. A rank's calls run in order on its stream, so only the oldest unfinished
// call of each rank is queried (one cudaEventQuery per rank per pass, which keeps the driver lock free for the
// handlers). Its clock starts when the watchdog sees the call before it done (or, for the first, when it was
// queued): a call is timed from when it could start, which includes any other work the stream runs between
// two watched calls.
void WatchOnce(Watchdog& w) {
  std::vector<std::pair<int64_t, std::string>> hangs;
  std::vector<std::pair<int64_t, std::string>> stuck_launches;
  std::vector<std::string> warnings;
  const std::vector<std::pair<int64_t, std::string>> async_errors = CommAsyncErrors();  // outside w.mu
  {
    std::lock_guard<std::mutex> lock(w.mu);
    const int64_t now = NowNs();
    std::set<std::pair<int64_t, int>> busy;  // (comm_id, rank) whose oldest call is still running
    auto hung = [&](int64_t comm_id) {
      return std::any_of(hangs.begin(), hangs.end(), [&](const auto& h) { return h.first == comm_id; });
    };
    for (auto it = w.pending.begin(); it != w.pending.end();) {
      const std::pair<int64_t, int> rank_key{it->call.comm_id, it->call.rank};
      if (busy.count(rank_key)) {
        ++it;
        continue;
      }
      busy.insert(rank_key);
      if (it->started_ns == 0) it->started_ns = std::max(now, it->opened_ns);
      if (it->end == nullptr) {
        // Still inside NCCL's launch: NCCL sets up connections on first use, which waits for the peers on the
        // host. An abort would wait for the launch to return (the handler's CommLease), so only report it.
        if (std::string warning = LateWarning(w, it->call, now - it->opened_ns, /*queueing=*/true); !warning.empty()) {
          warnings.push_back(std::move(warning));
        }
        if (!it->reported && now - it->opened_ns > it->call.timeout_ns) {
          it->reported = true;
          std::string message = HangMessage(w, it->call);
          message.replace(message.find("has not finished"), std::string("has not finished").size(),
                          "is still being queued by NCCL (connection set-up waits for the peers)");
          stuck_launches.emplace_back(it->call.comm_id, message.substr(0, message.rfind("; the communicator")));
        }
        ++it;
        continue;
      }
      const cudaError_t ended = cudaEventQuery(it->end);
      cudaGetLastError();
      if (ended != cudaErrorNotReady) {  // done (or its device failed: nothing left to wait for)
        ReturnEvent(it->end);
        it->end = nullptr;
        if (!it->warn_only) w.last_done[it->call.comm_id] = *it;
        // Within a host NCCL gives no error when peers abort: their abort can end this rank's kernel early,
        // near their timeout. Such a call is worth asking the other processes about (comm.py, check_errors).
        if (!it->warn_only && now - it->started_ns > it->call.timeout_ns / 2) {
          const WatchedCall& late = it->call;
          w.late[late.comm_id] = {late.sequence, DescribeCall(late) + " finished only " +
                                                     DescribeSeconds(now - it->started_ns) +
                                                     " after it could start on rank " + std::to_string(late.rank) +
                                                     " of " + std::to_string(late.size) + " (timeout " +
                                                     DescribeSeconds(late.timeout_ns) + ")"};
        }
        it = w.pending.erase(it);
        busy.erase(rank_key);  // the rank's next call may start now
        continue;
      }
      if (!it->warn_only && now - it->started_ns > it->call.timeout_ns && !hung(it->call.comm_id)) {
        hangs.emplace_back(it->call.comm_id, HangMessage(w, it->call));
      } else if (std::string warning = LateWarning(w, it->call, now - it->started_ns, /*queueing=*/false,
                                                   it->warn_only);
                 !warning.empty()) {
        warnings.push_back(std::move(warning));
      }
      ++it;
    }
    // A peer's abort or death ends this rank's NCCL kernels early, with garbage outputs and no hang: only
    // NCCL's asynchronous error tells. Name the call running then, or else the last one done.
    for (const auto& [comm_id, nccl_error] : async_errors) {
      if (hung(comm_id)) continue;
      const auto running = std::find_if(w.pending.begin(), w.pending.end(),
                                        [&](const Watched& watched) { return watched.call.comm_id == comm_id; });
      const auto done = w.last_done.find(comm_id);
      if (running != w.pending.end()) {
        hangs.emplace_back(comm_id, HangMessage(w, running->call, nccl_error));
      } else if (done != w.last_done.end()) {
        hangs.emplace_back(comm_id, HangMessage(w, done->second.call, nccl_error));
      } else {
        hangs.emplace_back(comm_id, "NCCL reports " + nccl_error + " on communicator " + std::to_string(comm_id) +
                                        " (a peer aborted or died); the communicator is aborted");
      }
    }
    for (const auto& [comm_id, message] : hangs) {
      // Aborted kernels return, so the events complete; drop the entries now either way (their events are
      // not reused: they may complete late).
      for (auto it = w.pending.begin(); it != w.pending.end();) {
        it = it->call.comm_id == comm_id && it->end != nullptr ? w.pending.erase(it) : std::next(it);
      }
    }
  }
  // On stderr, as XLA's own warnings about a stuck collective: the call goes on waiting.
  for (const std::string& warning : warnings) std::fprintf(stderr, "jax_ncclx: warning: %s\n", warning.c_str());
  if (!warnings.empty()) std::fflush(stderr);
  for (const auto& [comm_id, message] : stuck_launches) RecordCommFault(comm_id, message);
  for (const auto& [comm_id, message] : hangs) AbortComm(comm_id, message);
  for (const auto& [comm_id, message] : FindHungReplays()) AbortComm(comm_id, message);

  // NVLink kernels report their own timeouts; make them visible at once and to the NCCL handlers.
  RecordNvlinkFaults();
}

void WatchLoop() {
  Watchdog& w = GetWatchdog();
  std::unique_lock<std::mutex> lock(w.mu);
  while (!w.stop) {
    w.wake.wait_for(lock, kPollInterval, [&] { return w.stop; });
    if (w.stop) break;
    lock.unlock();
    WatchOnce(w);
    lock.lock();
  }
}

}  // namespace

WatchdogState GetWatchdogState() {
  Watchdog& w = GetWatchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  WatchdogState state;
  for (const auto& [key, sequence] : w.reached) state.reached.emplace_back(key.first, key.second, sequence);
  state.unnamed.assign(w.unnamed.begin(), w.unnamed.end());
  for (const auto& [comm_id, call] : w.late) state.late.emplace_back(comm_id, call.first, call.second);
  return state;
}

void WatchNow() { WatchOnce(GetWatchdog()); }

void RecordNvlinkFaults() {
  const std::vector<NvlinkFaultReport> reports = NvlinkFaultReports();
  for (const NvlinkFaultReport& report : reports) {
    if (CommFaultOf(report.comm_id).empty()) {
      RecordCommFault(report.comm_id, NvlinkFaultMessage(report.comm_id, reports));
    }
  }
}

void StartWatchdog() {
  Watchdog& w = GetWatchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  if (w.running) return;
  w.running = true;
  w.stop = false;
  w.thread = new std::thread(WatchLoop);
}

void StopWatchdog() {
  Watchdog& w = GetWatchdog();
  std::thread* thread = nullptr;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.running) return;
    w.stop = true;
    w.running = false;
    thread = w.thread;
    w.thread = nullptr;
  }
  w.wake.notify_all();
  thread->join();
  delete thread;
}

void ForgetWatchedCalls() {
  Watchdog& w = GetWatchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  w.pending.clear();  // left only by hung calls, whose events are not reused (see WatchOnce)
  w.reached.clear();
  w.unnamed.clear();
  w.last_done.clear();
  w.late.clear();
  w.warned.clear();
  ForgetCapturedCalls();
}

ffi::ErrorOr<GpuCall> BeginGpuCall(std::string_view op, const CallAttrs& attrs, int64_t comm_id, int rank, int size,
                                   int32_t device, cudaStream_t stream) {
  NCCLX_RETURN_IF_ERROR(CheckCommUsable(op, comm_id));
  GpuCall call;
  call.op = op;
  call.attrs = attrs;
  call.comm_id = comm_id;
  call.rank = rank;
  call.size = size;
  call.device = device;
  call.stream = stream;
  call.sequence = NextSequence(comm_id, rank);
  call.fault = InjectedFaultFor(rank, call.sequence);
  return call;
}

ffi::Error CheckNvlinkFault(std::string_view op, int64_t comm_id, const SymmetricRank& symmetric) {
  if (symmetric.fault == nullptr ||
      reinterpret_cast<const volatile NvlinkFault*>(symmetric.fault)->state == kNvlinkHealthy) {
    return ffi::Error::Success();
  }
  const std::string message = NvlinkFaultMessage(comm_id, NvlinkFaultReports());
  RecordCommFault(comm_id, message);
  return UnusableCommError(op, comm_id, message);
}

ffi::ErrorOr<CallBracket> OpenCall(const GpuCall& call, bool watch) {
  CallBracket bracket;
  const bool nccl = watch;
  watch = watch && call.attrs.timeout_ms > 0;  // JAX_NCCLX_TIMEOUT_S=0: no watchdog
  // NVLink kernels time themselves out on the device but say nothing before: the watchdog gives them the
  // late-peer warning from an event after the launch, as it does NCCL calls.
  const bool warn_only = !nccl && call.attrs.timeout_ms > 0 && call.attrs.warn_ms > 0 &&
                         call.attrs.warn_ms < call.attrs.timeout_ms;
  bracket.skip = ApplyDelayOrSkip(call.fault, /*stall_on_host=*/false);
  if (call.fault && call.fault->kind == FaultKind::kDelay) {  // the communicator may have failed meanwhile
    NCCLX_RETURN_IF_ERROR(CheckCommUsable(call.op, call.comm_id));
  }
  if (bracket.skip) return bracket;
  if (call.fault && call.fault->kind == FaultKind::kStall) {
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(call.op, "LaunchDeviceStall", LaunchDeviceStall(call.fault->delay_ms * 1000000, call.stream)));
  }
  if (!nccl && !warn_only && !call.attrs.trace) return bracket;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  NCCLX_RETURN_IF_ERROR(CheckCuda(call.op, "cudaStreamIsCapturing", cudaStreamIsCapturing(call.stream, &capture)));
  if (capture != cudaStreamCaptureStatusNone) {
    // Replays never come back to the host: only the replay watch times them.
    if (nccl) MarkCommCaptured(call.comm_id);
    bracket.watch_replays = watch && WatchReplays();
    return bracket;
  }
  watch = watch || warn_only;
  if (!watch && !call.attrs.trace) return bracket;
  if (call.attrs.trace) {
    NCCLX_RETURN_IF_ERROR(EnsureAnchor(call.op, call.device));
    CallRecord& r = bracket.record;
    r.site = call.attrs.site;
    r.comm = call.comm_id;
    r.group = -1;
    r.sequence = call.sequence;
    r.rank = call.rank;
    r.device = call.device;
    r.enqueue_ns = NowNs();
    r.injected = call.fault ? static_cast<int32_t>(call.fault->kind) : -1;
    ffi::ErrorOr<cudaEvent_t> start = TakeEvent(call.op, call.device, /*timing=*/true);
    if (start.has_error()) return start.error();
    r.start_event = *start;
    NCCLX_RETURN_IF_ERROR(CheckCuda(call.op, "cudaEventRecord", cudaEventRecord(*start, call.stream)));
  }
  if (watch) {
    Watched watched;
    watched.call = DescribeWatchedCall(call);
    watched.opened_ns = NowNs();
    watched.warn_only = warn_only;
    Watchdog& w = GetWatchdog();
    {
      std::lock_guard<std::mutex> lock(w.mu);
      watched.id = bracket.watch_id = w.next_id++;
      int64_t& reached = w.reached.try_emplace({call.comm_id, call.rank}, -1).first->second;
      reached = std::max(reached, call.sequence);
      w.pending.push_back(std::move(watched));
    }
    StartWatchdog();
  }
  return bracket;
}

ffi::Error CloseCall(const GpuCall& call, CallBracket& bracket, ffi::Error launched, void* output,
                     int64_t output_bytes) {
  if (bracket.watch_replays && launched.success()) {
    launched = WatchCapturedCall(DescribeWatchedCall(call), call.stream);
    if (launched.success()) StartWatchdog();
  }
  cudaEvent_t watch_end = nullptr;
  if (bracket.watch_id != 0 && launched.success()) {
    ffi::ErrorOr<cudaEvent_t> end = TakeEvent(call.op, call.device, /*timing=*/false);
    if (end.has_error()) {
      launched = end.error();
    } else {
      watch_end = *end;
      launched = CheckCuda(call.op, "cudaEventRecord", cudaEventRecord(watch_end, call.stream));
    }
  }
  if (bracket.watch_id != 0) {
    Watchdog& w = GetWatchdog();
    std::lock_guard<std::mutex> lock(w.mu);
    for (auto it = w.pending.rbegin(); it != w.pending.rend(); ++it) {
      if (it->id != bracket.watch_id) continue;
      if (launched.success()) {
        it->end = watch_end;
      } else {  // nothing was queued after all
        ReturnEvent(watch_end);
        w.pending.erase(std::next(it).base());
      }
      break;
    }
  }
  if (launched.failure()) {
    ReturnEvent(static_cast<cudaEvent_t>(bracket.record.start_event));
    return launched;
  }
  if (call.fault && call.fault->kind == FaultKind::kCorruptPayload && output_bytes >= 4) {
    uint8_t* middle = static_cast<uint8_t*>(output) + (output_bytes / 2) / 4 * 4;
    NCCLX_RETURN_IF_ERROR(CheckCuda(call.op, "cudaMemsetAsync", cudaMemsetAsync(middle, 0xA5, 4, call.stream)));
  }
  if (bracket.record.start_event != nullptr) {
    ffi::ErrorOr<cudaEvent_t> end = TakeEvent(call.op, call.device, /*timing=*/true);
    if (end.has_error()) return end.error();
    bracket.record.end_event = *end;
    NCCLX_RETURN_IF_ERROR(CheckCuda(call.op, "cudaEventRecord", cudaEventRecord(*end, call.stream)));
    int64_t index = 0;
    CallRecord evicted = AppendCallRecord(bracket.record, &index);
    ReturnEvent(static_cast<cudaEvent_t>(evicted.start_event));
    ReturnEvent(static_cast<cudaEvent_t>(evicted.end_event));
  }
  return ffi::Error::Success();
}

void ResetTraceAnchors() {
  std::lock_guard<std::mutex> lock(anchors_mu);
  for (auto& [device, anchor] : anchors) cudaEventDestroy(anchor.event);
  anchors.clear();
}

void ResolveCallRecord(CallRecord& record) {
  auto to_host_ns = [&](void* event) -> int64_t {
    if (event == nullptr) return 0;
    std::lock_guard<std::mutex> lock(anchors_mu);
    const auto anchor = anchors.find(record.device);
    float ms = 0;
    if (anchor == anchors.end() ||
        cudaEventElapsedTime(&ms, anchor->second.event, static_cast<cudaEvent_t>(event)) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return anchor->second.host_ns + static_cast<int64_t>(static_cast<double>(ms) * 1e6);
  };
  record.start_ns = to_host_ns(record.start_event);
  record.end_ns = to_host_ns(record.end_event);
  ReturnEvent(static_cast<cudaEvent_t>(record.start_event));
  ReturnEvent(static_cast<cudaEvent_t>(record.end_event));
  record.start_event = record.end_event = nullptr;
}

}  // namespace jax_ncclx
