#include "common/replay_watch_kernels.h"

#include "common/device_sync.cuh"

namespace jax_ncclx {
namespace {

__global__ void MarkReplayKernel(uint64_t* count, ReplayMark* mark) {
  const uint64_t replays = *count + 1;  // replays of one graph run one after another: no atomic needed
  *count = replays;
  StoreRelaxed(&mark->device_ns, GlobalTimerNs());
  StoreRelaxed(&mark->replays, replays);
}

__global__ void DeviceStallKernel(int64_t ns) {
  const uint64_t until = GlobalTimerNs() + static_cast<uint64_t>(ns);
  while (GlobalTimerNs() < until) __nanosleep(100000);
}

}  // namespace

cudaError_t LaunchMarkReplay(uint64_t* count, ReplayMark* mark, cudaStream_t stream) {
  MarkReplayKernel<<<1, 1, 0, stream>>>(count, mark);
  return cudaGetLastError();
}

cudaError_t LaunchDeviceStall(int64_t ns, cudaStream_t stream) {
  DeviceStallKernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace jax_ncclx
