// Device-side building blocks of the NVLink kernels: system-scope flag stores and waits across GPUs, and the
// per-call timeline they record when a program is traced (DeviceTraceRecord in symmetric_layout.h).
#pragma once

#include <cstdint>

#include "common/symmetric_layout.h"

namespace jax_ncclx {

// A flag holds an epoch, the number of the call that raised it; its writer may set this bit besides, a note
// for the reader (all_to_allv_dynamic: zero rows left to the receiver). Waits compare the epoch alone.
constexpr uint64_t kFlagNote = uint64_t{1} << 63;

__device__ __forceinline__ void StoreRelease(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// A release for the threads of this GPU alone (a flag no peer reads): gpu scope, not sys.
__device__ __forceinline__ void StoreReleaseGpu(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void StoreRelaxed(uint64_t* word, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t LoadRelaxed(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

// 16 bytes as one vector access (a lane's part of an LL128 line). Volatile, as NCCL's LL128: neither cached in
// L1 nor merged with other accesses by the compiler.
struct Pair64 {
  uint64_t lo, hi;
};

__device__ __forceinline__ void StoreVolatile(Pair64* to, Pair64 value) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(to), "l"(value.lo), "l"(value.hi) : "memory");
}

__device__ __forceinline__ Pair64 LoadVolatile(const Pair64* from) {
  Pair64 value;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(value.lo), "=l"(value.hi) : "l"(from) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Bounded waiting, for one thread of an NVLink kernel call. A wait that outlasts the call's timeout gives
// up: it marks the awaited rank missing in this rank's fault record (NvlinkFault), aborts the communicator on
// every rank (SymmetricControl::abort_by) and returns false; from then on every wait of every rank on the
// communicator returns false at once. A call that gave up still runs to its end, without waiting: its
// outputs are undefined, but its reads and writes stay inside its buffers, and the host reports the fault at
// the next call (watchdog.h). The clock starts at the first check, so a wait that succeeds early costs no
// timer read.
//
// kInlineReports: where the code of the two ways of giving up goes. Out of line (false) it is one call per
// wait; inline (true) it is copied into every wait, which makes the small collectives' kernels up to twice
// as large and some of them spill, but on one H100 left the exchange 0.25 µs faster at T = 128 than the
// calls did, so the exchange keeps it inline.
template <bool kInlineReports = false>
class Patience {
 public:
  __device__ Patience(const PeerTable* table, SymmetricControl* control, int rank, int size, uint64_t epoch,
                      TraceKernel kernel, int64_t site, uint64_t timeout_ns)
      : table_(table),
        control_(control),
        rank_(rank),
        size_(size),
        epoch_(epoch),
        kernel_(kernel),
        site_(site),
        timeout_ns_(timeout_ns) {}  // an abort is seen at the first check: reading it here would stall the call

  // Waits until the epoch in *flag (kFlagNote aside) is at least `value`, a flag that `peer` raises; `seen`
  // (when not null) receives the flag's last value, note included.
  __device__ bool AtLeast(const uint64_t* flag, uint64_t value, int peer, uint64_t* seen = nullptr) {
    uint64_t flag_value = LoadAcquire(flag);
    bool reached = true;
    for (uint32_t spins = 1; (flag_value & ~kFlagNote) < value; ++spins) {
      if (spins % kSpinsPerCheck == 0 && !KeepWaiting(peer)) {
        reached = false;
        break;
      }
      flag_value = LoadAcquire(flag);
    }
    if (seen != nullptr) *seen = flag_value;
    return reached;
  }

  // AtLeast for a wait that precedes writes into `peer`'s output (direct mode), which a peer that gave up on
  // this rank may have left to XLA for other data: false also when the communicator was aborted before the
  // wait began. The abort is read first and tested after the wait, so that its load overlaps the polls. (A
  // peer giving up while the wait ends stays a race; this closes the common case, a rank later than the
  // timeout, whose peers aborted long before its call began.)
  __device__ bool AtLeastUnaborted(const uint64_t* flag, uint64_t value, int peer, uint64_t* seen = nullptr) {
    const uint32_t aborted_by = AbortedBy(control_);
    const bool reached = AtLeast(flag, value, peer, seen);
    return reached && (aborted_by == 0 || Healthy());
  }

  // Waits until the low-latency word at `word` (written by `peer`) carries `tag`, and returns its payload
  // (on giving up, whatever the word holds).
  __device__ uint32_t Word(const uint64_t* word, uint32_t tag, int peer) {
    uint64_t seen = LoadRelaxed(word);
    for (uint32_t spins = 1; static_cast<uint32_t>(seen >> 32) != tag; ++spins) {
      if (spins % kSpinsPerCheck == 0 && !KeepWaiting(peer)) break;
      seen = LoadRelaxed(word);
    }
    return static_cast<uint32_t>(seen);
  }

  // Waits until holds(entry) for the 16-byte entry at `entry`, which `peer` writes, and returns it (on giving
  // up, whatever it holds).
  template <typename Holds>
  __device__ Pair64 Entry(const Pair64* entry, Holds holds, int peer) {
    Pair64 seen = LoadVolatile(entry);
    for (uint32_t spins = 1; !holds(seen) && !gave_up_; ++spins) {
      if (spins % kSpinsPerCheck == 0 && !KeepWaiting(peer)) break;
      seen = LoadVolatile(entry);
    }
    return seen;
  }

  // For a wait that a whole warp polls in step (every lane calls this after each failed poll, `spins` counting
  // them): whether to poll again, the same answer on every lane (false once any lane gave up on `peer`).
  __device__ bool WarpKeepsWaiting(uint32_t spins, int peer) {
    return __all_sync(0xffffffffu, spins % kSpinsPerCheck != 0 || KeepWaiting(peer));
  }

  // Whether this thread's waits gave up (or found the communicator aborted) during this call.
  __device__ bool GaveUp() const { return gave_up_; }

 private:
  static constexpr uint32_t kSpinsPerCheck = 1024;

  __device__ static uint32_t AbortedBy(const SymmetricControl* control) {
    return *reinterpret_cast<const volatile uint32_t*>(&control->abort_by);
  }

  // False once this call gave up or the communicator was aborted (recording the abort the first time).
  __device__ bool Healthy() {
    if (gave_up_) return false;
    if (AbortedBy(control_) == 0) return true;
    gave_up_ = true;
    if constexpr (kInlineReports) {
      ReportAborted(table_, control_, size_, kernel_, epoch_, site_);
    } else {
      ReportAbortedOutOfLine(table_, control_, size_, kernel_, epoch_, site_);
    }
    return false;
  }

  __device__ bool KeepWaiting(int peer) {
    if (!Healthy()) return false;
    if (timeout_ns_ == 0) return true;  // JAX_NCCLX_TIMEOUT_S=0: wait forever
    const uint64_t now = GlobalTimerNs();
    if (started_ns_ == 0) started_ns_ = now;
    if (now - started_ns_ < timeout_ns_) return true;
    gave_up_ = true;
    if constexpr (kInlineReports) {
      ReportGaveUp(table_, rank_, size_, peer, now - started_ns_, kernel_, epoch_, site_);
    } else {
      ReportGaveUpOutOfLine(table_, rank_, size_, peer, now - started_ns_, kernel_, epoch_, site_);
    }
    return false;
  }

  // The two ways of giving up, each run at most once per call. Static, with the fields as arguments, so that
  // no Patience is taken by address and moved out of registers when they are called out of line.
  //
  // This rank waited in vain for `peer`: records it, then marks `peer` missing and this rank the aborter on
  // every rank of the communicator.
  __device__ __forceinline__ static void ReportGaveUp(const PeerTable* table, int rank, int size, int peer,
                                                      uint64_t waited_ns, TraceKernel kernel, uint64_t epoch,
                                                      int64_t site) {
    volatile NvlinkFault* fault = table->fault;
    fault->missing[peer] = 1;
    Describe(fault, kernel, epoch, site);
    fault->waited_ns = waited_ns;
    __threadfence_system();
    fault->state = kNvlinkGaveUp;
    for (int r = 0; r < size; ++r) atomicOr_system(&table->control[r]->abort_missing, 1u << peer);
    __threadfence_system();  // the missing rank is visible before the abort
    for (int r = 0; r < size; ++r) {
      *reinterpret_cast<volatile uint32_t*>(&table->control[r]->abort_by) = static_cast<uint32_t>(rank + 1);
    }
    __threadfence_system();
  }

  // Another rank aborted the communicator: records who and whom it missed, unless this rank's record already
  // holds a fault.
  __device__ __forceinline__ static void ReportAborted(const PeerTable* table, const SymmetricControl* control,
                                                       int size, TraceKernel kernel, uint64_t epoch, int64_t site) {
    volatile NvlinkFault* fault = table->fault;
    if (fault->state != kNvlinkHealthy) return;
    Describe(fault, kernel, epoch, site);
    fault->aborted_by = AbortedBy(control);
    const uint32_t missing = *reinterpret_cast<const volatile uint32_t*>(&control->abort_missing);
    for (int r = 0; r < size; ++r) fault->missing[r] = (missing >> r) & 1u;
    __threadfence_system();
    fault->state = kNvlinkAborted;
  }

  __device__ __noinline__ static void ReportGaveUpOutOfLine(const PeerTable* table, int rank, int size, int peer,
                                                            uint64_t waited_ns, TraceKernel kernel, uint64_t epoch,
                                                            int64_t site) {
    ReportGaveUp(table, rank, size, peer, waited_ns, kernel, epoch, site);
  }
  __device__ __noinline__ static void ReportAbortedOutOfLine(const PeerTable* table, const SymmetricControl* control,
                                                             int size, TraceKernel kernel, uint64_t epoch,
                                                             int64_t site) {
    ReportAborted(table, control, size, kernel, epoch, site);
  }

  __device__ static void Describe(volatile NvlinkFault* fault, TraceKernel kernel, uint64_t epoch, int64_t site) {
    fault->kernel = kernel;
    fault->epoch = epoch;
    fault->site = site;
  }

  const PeerTable* table_;
  SymmetricControl* control_;
  int rank_;
  int size_;
  uint64_t epoch_;
  TraceKernel kernel_;
  int64_t site_;
  uint64_t timeout_ns_;
  uint64_t started_ns_ = 0;
  bool gave_up_ = false;
};

// Copies units [lo, hi) from src to dst with the whole block of kThreads threads, kUnroll loads in flight per
// thread. `kFromPeers`: src is written by other GPUs during the kernel, so it is read past L1 (ld.global.cg).
template <typename V, bool kFromPeers, int kThreads, int kUnroll = 4>
__device__ __forceinline__ void BlockCopy(V* dst, const V* src, int64_t lo, int64_t hi) {
  int64_t i = lo + threadIdx.x;
  for (; i + (kUnroll - 1) * int64_t{kThreads} < hi; i += kUnroll * int64_t{kThreads}) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = kFromPeers ? __ldcg(src + i + u * kThreads) : src[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * kThreads] = v[u];
  }
  for (; i < hi; i += kThreads) dst[i] = kFromPeers ? __ldcg(src + i) : src[i];
}

// Records one call's timeline into `control->trace` when `trace` is set; every method is a no-op otherwise.
// Called by one thread per block.
class CallTrace {
 public:
  __device__ CallTrace(SymmetricControl* control, uint64_t epoch, bool trace)
      : record_(trace ? &control->trace[epoch % kTraceSlots] : nullptr) {}

  __device__ bool Enabled() const { return record_ != nullptr; }

  __device__ void Start() {
    if (record_ != nullptr && blockIdx.x == 0) record_->start_ns = GlobalTimerNs();
  }
  __device__ void PeersEntered() { Latest(&record_->peers_ns); }
  __device__ void Ready() { Latest(&record_->ready_ns); }
  __device__ void Sent() { Latest(&record_->sent_ns); }
  __device__ void DataArrived() { Latest(&record_->data_ns); }
  // By the last block to finish, before it publishes `epoch`.
  __device__ void End(uint64_t epoch, TraceKernel kernel) {
    if (record_ == nullptr) return;
    record_->end_ns = GlobalTimerNs();
    record_->blocks = gridDim.x;
    record_->kernel = kernel;
    __threadfence();
    record_->epoch = epoch;
  }

 private:
  __device__ void Latest(uint64_t* field) {
    if (record_ != nullptr) atomicMax(reinterpret_cast<unsigned long long*>(field), GlobalTimerNs());
  }

  DeviceTraceRecord* record_;
};

// One process: peers write into each other's outputs. Tells the owner of `peer_control` where this rank's
// output for call `epoch` is and, with `enter`, raises `entered` there (the output is free for its writes
// from then on). The release orders the address, and this thread's earlier writes, before the flag; without
// `enter`, a later release of this thread to the same peer (a data flag) brings the address.
__device__ __forceinline__ void PublishOutput(SymmetricControl* peer_control, int rank, const void* output,
                                              uint64_t epoch, bool enter) {
  peer_control->output[rank] = reinterpret_cast<uint64_t>(output);
  if (enter) StoreRelease(&peer_control->entered[rank], epoch);
}

// Where `peer` published its output for this call (PublishOutput), read once one of its flags was seen.
template <typename V>
__device__ __forceinline__ V* PeerOutput(const SymmetricControl* control, int peer) {
  return reinterpret_cast<V*>(control->output[peer]);
}

// The epoch of the call this kernel runs: one more than the calls finished on the communicator. Kernels on
// one stream run one after another, so every block of a call reads the same value.
__device__ __forceinline__ uint64_t CallEpoch(const SymmetricControl* control) {
  return *reinterpret_cast<const volatile uint64_t*>(&control->epoch) + 1;
}

// Thread 0 of each block of a multi-block call takes a ticket once it has read `epoch` (the atomic waits for
// the value), at the start, so that its round trip overlaps the call: the block that gets the last ticket
// knows every block has read the epoch, and publishes the next one in FinishCall. Other threads get 0.
__device__ __forceinline__ uint32_t TakeTicket(SymmetricControl* control, uint64_t epoch) {
  if (gridDim.x == 1 || threadIdx.x != 0) return 0;
  return atomicAdd(&control->blocks_started, static_cast<uint32_t>(epoch != 0));  // always 1, after the read
}

// Ends the call: publishes `epoch` for the next call (the block of the last ticket, or the only block) and,
// when traced, the last block to finish records the timeline. Every thread of every block calls it.
__device__ __forceinline__ void FinishCall(SymmetricControl* control, uint64_t epoch, uint32_t ticket, CallTrace& trace,
                                           TraceKernel kernel) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) {  // no other block to count; the next kernel on the stream sees the store
    trace.End(epoch, kernel);
    control->epoch = epoch;
    return;
  }
  // No other block reads the epoch again, and the next kernel on the stream sees these stores after this
  // one ends. No fence: it would wait for this thread's NVLink stores to be acknowledged (about a microsecond
  // on every small call).
  if (ticket == gridDim.x - 1) {
    control->blocks_started = 0;
    control->epoch = epoch;
  }
  if (!trace.Enabled()) return;
  __threadfence();  // the blocks' timestamps, before the count that lets the last block read them
  if (atomicAdd(&control->blocks_done, 1u) == gridDim.x - 1) {
    control->blocks_done = 0;
    trace.End(epoch, kernel);
  }
}

}  // namespace jax_ncclx
