// Device side of watching replayed NCCL calls (replay_watch.h) and of the injected "stall" fault.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ncclx {

// What the device reports after each replay of a watched call, in pinned host memory that the watchdog reads
// without a CUDA call.
struct ReplayMark {
  uint64_t replays = 0;    // replays that got past the call
  uint64_t device_ns = 0;  // the device clock (%globaltimer) when the latest one did
};

// One thread on `stream`: counts a replay in `*count` (device memory, so the count needs no read across
// PCIe) and publishes the count and the time to `*mark` (the device view of pinned host memory).
cudaError_t LaunchMarkReplay(uint64_t* count, ReplayMark* mark, cudaStream_t stream);

// One thread on `stream` that spins for `ns` nanoseconds of the device clock: a GPU stuck in earlier work,
// which holds in CUDA graph replays too (FaultKind::kStall).
cudaError_t LaunchDeviceStall(int64_t ns, cudaStream_t stream);

}  // namespace jax_ncclx
