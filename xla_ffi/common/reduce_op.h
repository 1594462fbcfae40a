// The reductions of all_reduce and reduce_scatter, as their reduce_op attribute carries them (primitive.py's
// REDUCE_OPS). Plain C++, so that the CPU handlers, the NCCL handlers and the NVLink kernels share it.
#pragma once

namespace jax_ncclx {

enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2 };

}  // namespace jax_ncclx
