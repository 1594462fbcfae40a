// Device-side building blocks of the NVLink kernels: system-scope flag stores and waits across GPUs, and the
// per-call timeline they record when a program is traced (DeviceTraceRecord in symmetric_layout.h).
#pragma once

#include <cstdint>

#include "common/symmetric_layout.h"

namespace jax_ncclx {

__device__ __forceinline__ void StoreRelease(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
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

__device__ __forceinline__ void WaitAtLeast(const uint64_t* flag, uint64_t epoch) {
  while (LoadAcquire(flag) < epoch) {
  }
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

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

  __device__ void Start() {
    if (record_ != nullptr && blockIdx.x == 0) record_->start_ns = GlobalTimerNs();
  }
  __device__ void PeersEntered() { Latest(&record_->peers_ns); }
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

// The epoch of the call this kernel runs: one more than the calls finished on the communicator. Kernels on
// one stream run one after another, so every block of a call reads the same value.
__device__ __forceinline__ uint64_t CallEpoch(const SymmetricControl* control) {
  return *reinterpret_cast<const volatile uint64_t*>(&control->epoch) + 1;
}

// Ends the call: the last block to finish records the trace and publishes `epoch` for the next call.
// Every thread of every block calls it.
__device__ __forceinline__ void FinishCall(SymmetricControl* control, uint64_t epoch, CallTrace& trace,
                                           TraceKernel kernel) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) {  // no other block to count; the next kernel on the stream sees the store
    trace.End(epoch, kernel);
    control->epoch = epoch;
    return;
  }
  __threadfence();
  if (atomicAdd(&control->blocks_done, 1u) == gridDim.x - 1) {
    control->blocks_done = 0;
    trace.End(epoch, kernel);
    control->epoch = epoch;
    __threadfence();
  }
}

}  // namespace jax_ncclx
