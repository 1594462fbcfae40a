// The call-site names, sequence counters, injected faults and trace ring declared in monitor.h. Handlers run
// on one host thread per device, so the shared tables take a mutex; the hot paths (no fault set, trace off)
// touch only an atomic flag or nothing at all.
#include "common/monitor.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace jax_ncclx {
namespace {

std::mutex sites_mu;
std::map<int64_t, std::string> site_axes;

std::mutex sequences_mu;
std::map<std::pair<int64_t, int>, int64_t> sequences;

std::mutex faults_mu;
std::vector<InjectedFault> faults;
std::atomic<bool> any_faults{false};

std::mutex trace_mu;
std::vector<CallRecord> ring;  // kTraceCapacity slots once used
int64_t appended = 0;          // records appended since the last clear

}  // namespace

void NameCallSite(int64_t site, std::string axis) {
  std::lock_guard<std::mutex> lock(sites_mu);
  site_axes[site] = std::move(axis);
}

std::string DescribeCallSite(int64_t site) {
  std::lock_guard<std::mutex> lock(sites_mu);
  const auto it = site_axes.find(site);
  const std::string where = "call site " + std::to_string(site);
  return it == site_axes.end() ? where : "axis " + it->second + ", " + where;
}

// snprintf, not an ostream: streams crash in threads of this module, whose libstdc++ locale is its own.
std::string DescribeSeconds(uint64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g s", ns / 1e9);
  return text;
}

std::string RankList(const std::set<int>& ranks) {
  std::string out;
  for (const int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

int64_t NextSequence(int64_t comm, int rank) {
  std::lock_guard<std::mutex> lock(sequences_mu);
  return sequences[{comm, rank}]++;
}

void RestartSequences() {
  std::lock_guard<std::mutex> lock(sequences_mu);
  sequences.clear();
}

void SetInjectedFaults(std::vector<InjectedFault> new_faults) {
  std::lock_guard<std::mutex> lock(faults_mu);
  faults = std::move(new_faults);
  any_faults.store(!faults.empty(), std::memory_order_relaxed);
}

std::optional<InjectedFault> InjectedFaultFor(int rank, int64_t sequence) {
  if (!any_faults.load(std::memory_order_relaxed)) return std::nullopt;
  std::lock_guard<std::mutex> lock(faults_mu);
  for (const InjectedFault& fault : faults) {
    if (fault.rank == rank && fault.sequence == sequence) return fault;
  }
  return std::nullopt;
}

bool ApplyDelayOrSkip(const std::optional<InjectedFault>& fault, bool stall_on_host) {
  if (!fault) return false;
  if (fault->kind == FaultKind::kDelay || (fault->kind == FaultKind::kStall && stall_on_host)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(fault->delay_ms));
  }
  return fault->kind == FaultKind::kSkip;
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

CallRecord AppendCallRecord(const CallRecord& record, int64_t* index) {
  std::lock_guard<std::mutex> lock(trace_mu);
  if (ring.empty()) ring.resize(kTraceCapacity);
  const int64_t slot = appended % kTraceCapacity;
  CallRecord evicted = appended >= kTraceCapacity ? ring[slot] : CallRecord{};
  ring[slot] = record;
  *index = appended++;
  return evicted;
}

void UpdateCallRecord(int64_t index, const CallRecord& record) {
  std::lock_guard<std::mutex> lock(trace_mu);
  if (index < appended - kTraceCapacity || index >= appended) return;  // evicted meanwhile
  ring[index % kTraceCapacity] = record;
}

std::vector<CallRecord> TakeCallRecords() {
  std::lock_guard<std::mutex> lock(trace_mu);
  std::vector<CallRecord> out;
  const int64_t first = appended > kTraceCapacity ? appended - kTraceCapacity : 0;
  for (int64_t i = first; i < appended; ++i) out.push_back(ring[i % kTraceCapacity]);
  appended = 0;
  return out;
}

}  // namespace jax_ncclx
