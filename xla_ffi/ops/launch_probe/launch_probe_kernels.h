// Device side of the launch probe: one small kernel per call and no communication, the least a jax_ncclx op
// can cost inside an XLA program (benchmarks/launch_floor.py times chains of it against the collectives).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ncclx {

// Copies `bytes` from x to y with one thread block on `stream`.
cudaError_t LaunchCopyProbe(const void* x, void* y, int64_t bytes, cudaStream_t stream);

}  // namespace jax_ncclx
