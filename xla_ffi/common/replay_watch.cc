// The replay watch declared in replay_watch.h.
#include "common/replay_watch.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/replay_watch_kernels.h"

namespace jax_ncclx {
namespace {

std::atomic<bool> watch_replays{false};

constexpr int kMarksPerChunk = 1024;
constexpr size_t kMaxCapturedCalls = 16384;  // since the last destroy_all

// A device's marks: pinned host memory (mapped) and the device counts behind them, allocated a chunk at a time.
struct MarkChunk {
  ReplayMark* host = nullptr;
  ReplayMark* device_view = nullptr;
  uint64_t* counts = nullptr;
  int used = 0;
};

struct Watched {
  WatchedCall call;
  cudaEvent_t on_its_way = nullptr;
  const ReplayMark* mark = nullptr;  // host view
  uint64_t seen_replays = 0;
  int64_t waiting_since = 0;  // when the watchdog first saw it on its way since the rank's last progress
};

struct RankCalls {
  std::vector<size_t> calls;  // indices into ReplayWatch::calls, in capture order
  int64_t progress_ns = 0;    // host time of the last pass that saw one of them get past (or of the first)
};

struct ReplayWatch {
  std::mutex mu;
  std::map<int32_t, std::vector<MarkChunk>> chunks;
  std::vector<Watched> calls;
  std::map<std::pair<int64_t, int>, RankCalls> ranks;  // (comm_id, rank)
  bool said_full = false;
};

ReplayWatch& GetReplayWatch() {
  static ReplayWatch* watch = new ReplayWatch();
  return *watch;
}

// Runs `f` with potentially unsafe CUDA calls allowed on this thread, which may be capturing: allocations and
// a synchronous memset on a stream of our own touch nothing the capture records.
template <typename F>
ffi::Error OutsideCapture(F f) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  ffi::Error result = f();
  cudaThreadExchangeStreamCaptureMode(&mode);
  return result;
}

ffi::Error AddChunk(std::string_view op, std::vector<MarkChunk>& chunks) {
  constexpr size_t kMarkBytes = kMarksPerChunk * sizeof(ReplayMark), kCountBytes = kMarksPerChunk * sizeof(uint64_t);
  MarkChunk chunk;
  cudaStream_t side = nullptr;
  ffi::Error made = [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(op, "cudaHostAlloc",
                  cudaHostAlloc(&chunk.host, kMarkBytes, cudaHostAllocMapped | cudaHostAllocPortable)));
    std::fill(chunk.host, chunk.host + kMarksPerChunk, ReplayMark{});
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(op, "cudaHostGetDevicePointer",
                  cudaHostGetDevicePointer(reinterpret_cast<void**>(&chunk.device_view), chunk.host, 0)));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMalloc", cudaMalloc(&chunk.counts, kCountBytes)));
    NCCLX_RETURN_IF_ERROR(
        CheckCuda(op, "cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking)));
    NCCLX_RETURN_IF_ERROR(CheckCuda(op, "cudaMemsetAsync", cudaMemsetAsync(chunk.counts, 0, kCountBytes, side)));
    return CheckCuda(op, "cudaStreamSynchronize", cudaStreamSynchronize(side));
  }();
  if (side != nullptr) cudaStreamDestroy(side);
  if (made.success()) {
    chunks.push_back(chunk);
  } else {  // nothing captured uses the chunk yet
    if (chunk.counts != nullptr) cudaFree(chunk.counts);
    if (chunk.host != nullptr) cudaFreeHost(chunk.host);
  }
  return made;
}

// What a rank's calls of one site (one lowered call, possibly traced several times) show right now.
struct SiteView {
  std::string_view op;
  int64_t first_sequence = 0;  // capture order: stands for program order
  uint64_t replays = 0;        // replays that got past it, over all its traces
  uint64_t last_ns = 0;        // device clock when the latest did
  bool waiting = false;        // a replay is on its way and has not got past it
};

// The rank's sites, reading the marks and querying the events now.
std::map<int64_t, SiteView> ViewSites(ReplayWatch& w, const RankCalls& rank) {
  std::map<int64_t, SiteView> sites;
  for (const size_t index : rank.calls) {
    const Watched& watched = w.calls[index];
    auto [it, fresh] = sites.try_emplace(watched.call.site);
    SiteView& view = it->second;
    view.op = watched.call.op;
    if (fresh || watched.call.sequence < view.first_sequence) view.first_sequence = watched.call.sequence;
    const volatile ReplayMark* mark = reinterpret_cast<const volatile ReplayMark*>(watched.mark);
    const uint64_t replays = mark->replays, device_ns = mark->device_ns;
    view.replays += replays;
    view.last_ns = std::max(view.last_ns, device_ns);
    const cudaError_t state = cudaEventQuery(watched.on_its_way);
    cudaGetLastError();
    view.waiting |= state == cudaErrorNotReady;
  }
  return sites;
}

// The site a rank waits in: the first one on its way after the site that got past last, in capture order
// (wrapping around to the next replay). -1 when none is on its way.
int64_t WaitingSite(const std::map<int64_t, SiteView>& sites) {
  const SiteView* last = nullptr;
  for (const auto& [site, view] : sites) {
    if (view.replays > 0 && (last == nullptr || view.last_ns > last->last_ns)) last = &view;
  }
  int64_t first = -1, after_last = -1;
  int64_t first_order = INT64_MAX, after_order = INT64_MAX;
  for (const auto& [site, view] : sites) {
    if (!view.waiting) continue;
    if (view.first_sequence < first_order) first_order = view.first_sequence, first = site;
    if (last != nullptr && view.first_sequence > last->first_sequence && view.first_sequence < after_order) {
      after_order = view.first_sequence, after_last = site;
    }
  }
  return after_last >= 0 ? after_last : first;
}

std::string HangMessage(ReplayWatch& w, const Watched& stalled) {
  const WatchedCall& call = stalled.call;
  const std::map<int64_t, SiteView> own = ViewSites(w, w.ranks.at({call.comm_id, call.rank}));
  int64_t site = WaitingSite(own);
  if (site < 0) site = call.site;
  const SiteView& hung = own.at(site);
  std::set<int> never, local;
  ffi::ErrorOr<std::map<int32_t, CommMember>> members = CommMembers("watchdog", call.comm_id);
  if (members.has_value()) {
    for (const auto& [device, member] : *members) {
      local.insert(member.rank);
      if (member.rank == call.rank) continue;
      const auto calls = w.ranks.find({call.comm_id, member.rank});
      std::map<int64_t, SiteView> theirs;
      if (calls != w.ranks.end()) theirs = ViewSites(w, calls->second);
      const auto view = theirs.find(site);
      const bool reached = view != theirs.end() &&
                           (view->second.replays > hung.replays ||
                            (view->second.replays == hung.replays && WaitingSite(theirs) == site));
      if (!reached) never.insert(member.rank);
    }
  }
  std::string message = "a call replayed from a CUDA graph on communicator " + std::to_string(call.comm_id) + " (" +
                        std::string(hung.op) + ", " + DescribeCallSite(site) + "; its replay " +
                        std::to_string(hung.replays + 1) + " on this rank) has not finished " +
                        DescribeSeconds(call.timeout_ns) + " after it could start on rank " +
                        std::to_string(call.rank) + " of " + std::to_string(call.size) + " (" +
                        std::string(kTimeoutSettings) + "): ";
  if (!never.empty()) {
    message += "rank(s) " + RankList(never) + " never reached it";
  } else if (static_cast<int>(local.size()) < call.size) {
    message += "every rank in this process (" + RankList(local) +
               ") reached it; the missing rank(s) are among those in other processes (replays are not compared "
               "across processes)";
  } else {
    message += "every rank reached it, but NCCL did not complete it";
  }
  return message + "; the communicator is revoked";
}

}  // namespace

void SetWatchReplays(bool watch) { watch_replays.store(watch, std::memory_order_relaxed); }
bool WatchReplays() { return watch_replays.load(std::memory_order_relaxed); }

ffi::Error WatchCapturedCall(const WatchedCall& call, cudaStream_t stream) {
  ReplayWatch& w = GetReplayWatch();
  std::lock_guard<std::mutex> lock(w.mu);
  if (w.calls.size() >= kMaxCapturedCalls) {
    if (!w.said_full) {
      std::fprintf(stderr,
                   "jax_ncclx: %zu NCCL calls captured into CUDA graphs are watched; later captures are "
                   "not (JAX_NCCLX_WATCH_REPLAYS)\n",
                   kMaxCapturedCalls);
      w.said_full = true;
    }
    return ffi::Error::Success();
  }
  std::vector<MarkChunk>& chunks = w.chunks[call.device];
  Watched watched;
  watched.call = call;
  NCCLX_RETURN_IF_ERROR(OutsideCapture([&]() -> ffi::Error {
    if (chunks.empty() || chunks.back().used == kMarksPerChunk) NCCLX_RETURN_IF_ERROR(AddChunk(call.op, chunks));
    return CheckCuda(call.op, "cudaEventCreateWithFlags",
                     cudaEventCreateWithFlags(&watched.on_its_way, cudaEventDisableTiming));
  }));
  MarkChunk& chunk = chunks.back();
  const int slot = chunk.used++;
  watched.mark = chunk.host + slot;
  NCCLX_RETURN_IF_ERROR(CheckCuda(call.op, "cudaEventRecordWithFlags",
                                  cudaEventRecordWithFlags(watched.on_its_way, stream, cudaEventRecordExternal)));
  NCCLX_RETURN_IF_ERROR(
      CheckCuda(call.op, "LaunchMarkReplay", LaunchMarkReplay(chunk.counts + slot, chunk.device_view + slot, stream)));
  RankCalls& rank = w.ranks[{call.comm_id, call.rank}];
  if (rank.calls.empty()) rank.progress_ns = NowNs();
  rank.calls.push_back(w.calls.size());
  w.calls.push_back(watched);
  return ffi::Error::Success();
}

std::vector<std::pair<int64_t, std::string>> FindHungReplays() {
  ReplayWatch& w = GetReplayWatch();
  std::lock_guard<std::mutex> lock(w.mu);
  std::vector<std::pair<int64_t, std::string>> hangs;
  const int64_t now = NowNs();
  for (auto& [key, rank] : w.ranks) {
    const int64_t comm_id = key.first;
    if (!CommFaultOf(comm_id).empty() ||
        std::any_of(hangs.begin(), hangs.end(), [&](const auto& h) { return h.first == comm_id; })) {
      continue;
    }
    bool progressed = false;
    int64_t shortest_timeout = INT64_MAX;
    for (const size_t index : rank.calls) {
      Watched& watched = w.calls[index];
      const uint64_t replays = reinterpret_cast<const volatile ReplayMark*>(watched.mark)->replays;
      progressed |= replays != watched.seen_replays;
      watched.seen_replays = replays;
      shortest_timeout = std::min(shortest_timeout, watched.call.timeout_ns);
    }
    if (progressed) {
      rank.progress_ns = now;
      for (const size_t index : rank.calls) w.calls[index].waiting_since = 0;
      continue;
    }
    // Events are queried only once the counts stood still for a while, so a busy rank costs no CUDA call.
    if (now - rank.progress_ns < std::min<int64_t>(1000000000, shortest_timeout / 4)) continue;
    for (const size_t index : rank.calls) {
      Watched& watched = w.calls[index];
      const cudaError_t state = cudaEventQuery(watched.on_its_way);
      cudaGetLastError();
      if (state != cudaErrorNotReady) {
        watched.waiting_since = 0;
      } else if (watched.waiting_since == 0) {
        watched.waiting_since = now;
      } else if (now - watched.waiting_since > watched.call.timeout_ns) {  // set after the last progress
        hangs.emplace_back(comm_id, HangMessage(w, watched));
        break;
      }
    }
  }
  return hangs;
}

void ForgetCapturedCalls() {
  ReplayWatch& w = GetReplayWatch();
  std::lock_guard<std::mutex> lock(w.mu);
  w.calls.clear();
  w.ranks.clear();
  w.said_full = false;
  for (auto& [device, chunks] : w.chunks) {
    for (MarkChunk& chunk : chunks) chunk.used = kMarksPerChunk;  // kept, not reused (replay_watch.h)
  }
}

}  // namespace jax_ncclx
