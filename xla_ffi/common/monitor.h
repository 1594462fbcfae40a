// What every handler, CPU or CUDA, reports and consults about its calls, independent of how data moves:
//   * the attributes the Python lowering gives every call ("site", "timeout_ms", "warn_ms", "trace");
//   * the axis each call site runs over, for error messages (registered at lowering);
//   * sequence numbers: the n-th call a rank makes on a communicator (0, 1, 2, ...), the same on every rank
//     of a healthy program, so that traces of different ranks line up and faults can name a call;
//   * injected faults (JAX_NCCLX_FAULT, off by default): delay or skip a rank's call, stall its device before
//     it, corrupt its counts or its payload;
//   * the trace ring of JAX_NCCLX_TRACE=1: one record per call and rank.
// Each extension module links its own copy; Python talks to the module that runs the program.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/contract.h"

namespace jax_ncclx {

// Attributes every jax_ncclx custom call carries, in this order, before the op's own.
struct CallAttrs {
  int64_t site = 0;          // call site id, unique per lowered call in the process
  int64_t timeout_ms = 0;    // how long a participant waits for its peers; 0: forever
  int64_t warn_ms = 0;       // after how long waiting for late peers prints one warning; 0: never
  bool trace = false;        // record the call in the trace ring (attribute trace == 1)
  bool trace_device = false;  // NVLink kernels stamp their device timeline (trace == 1 or 2)
};

// The attribute `call` of every handler, as the lowering passes it (a dictionary of int64s; its FFI decoding
// is registered in contract_attrs.h): what MakeCallAttrs turns into CallAttrs.
struct RawCallAttrs {
  int64_t site = 0;
  int64_t timeout_ms = 0;
  int64_t warn_ms = 0;
  int64_t trace = 0;  // 1: the call is traced; 2: only the NVLink kernels' device timeline
};

template <typename Binding>
auto BindCallAttrs(Binding binding) {
  return std::move(binding).template Attr<RawCallAttrs>("call");
}

// The longest timeout the handlers keep (about 31 years): they count it in nanoseconds, which a larger one
// would overflow. Python's settings stay far below; a negative one, from no jax_ncclx lowering, waits forever.
inline constexpr int64_t kMaxTimeoutMs = int64_t{1} << 40;

inline CallAttrs MakeCallAttrs(const RawCallAttrs& raw) {
  return CallAttrs{raw.site, std::clamp<int64_t>(raw.timeout_ms, 0, kMaxTimeoutMs),
                   std::clamp<int64_t>(raw.warn_ms, 0, kMaxTimeoutMs), raw.trace == 1,
                   raw.trace == 1 || raw.trace == 2};
}

// Call sites: the axis name of each, for messages ("axis 'x'"). Unknown sites are described by number.
void NameCallSite(int64_t site, std::string axis);
std::string DescribeCallSite(int64_t site);
// "0.5 s", for messages.
std::string DescribeSeconds(uint64_t ns);
// "0, 2, 3", for messages.
std::string RankList(const std::set<int>& ranks);

// The sequence number of rank `rank`'s next call on communicator `comm` (any 64-bit key naming it).
int64_t NextSequence(int64_t comm, int rank);
// Forgets every communicator's numbers: the next call on any starts at 0.
void RestartSequences();

// ---- fault injection ---------------------------------------------------------------------------------------

struct InjectedFault {
  FaultKind kind = FaultKind::kDelay;
  int rank = 0;         // rank in the communicator
  int64_t sequence = 0;
  int64_t delay_ms = 0;  // kDelay, kStall
};

// Replaces the faults to inject. An empty list (the default) turns injection off.
void SetInjectedFaults(std::vector<InjectedFault> faults);

// The fault to inject into `rank`'s call number `sequence`, if any. One relaxed load when none is set.
std::optional<InjectedFault> InjectedFaultFor(int rank, int64_t sequence);

// Sleeps for a kDelay fault, and for a kStall fault when `stall_on_host` (CPU handlers: the host is the device;
// CUDA handlers stall their stream instead); returns true for a kSkip fault (the caller returns without doing
// the call).
bool ApplyDelayOrSkip(const std::optional<InjectedFault>& fault, bool stall_on_host);

// ---- trace ring -------------------------------------------------------------------------------------------

// One call on one rank. Times are nanoseconds of the system clock (CLOCK_REALTIME), comparable across the
// processes of one host; 0 when unknown (a call that never started or finished has 0 there).
struct CallRecord {
  int64_t site = 0;
  int64_t comm = 0;      // comm_id (GPU) or replica-group key (CPU)
  int64_t group = 0;     // replica group index (CPU; -1 on GPU, where comm names the group)
  int64_t sequence = 0;
  int32_t rank = 0;
  int32_t device = 0;    // CUDA ordinal (GPU) or partition id (CPU)
  int64_t enqueue_ns = 0;  // the handler ran (host)
  int64_t start_ns = 0;    // the call began on the device (CPU: the handler)
  int64_t arrive_ns = 0;   // every peer had arrived (CPU only)
  int64_t end_ns = 0;      // the call finished
  int32_t injected = -1;   // FaultKind injected into this call, or -1
  void* start_event = nullptr;  // CUDA events that fill start_ns / end_ns when the trace is read
  void* end_event = nullptr;
};

constexpr int64_t kTraceCapacity = 1 << 16;  // the newest records are kept

int64_t NowNs();

// Appends a record and sets `*index` for later updates (valid until kTraceCapacity newer records). Returns
// the record it evicted (zeros when the ring was not full), whose CUDA events the caller releases.
CallRecord AppendCallRecord(const CallRecord& record, int64_t* index);
void UpdateCallRecord(int64_t index, const CallRecord& record);
// Every kept record, oldest first, leaving the ring empty: the caller owns the records' CUDA events now (a
// copy left in the ring would return them to the pool a second time when evicted).
std::vector<CallRecord> TakeCallRecords();

}  // namespace jax_ncclx
