// Host launchers of the moe routing kernels (moe_routing_kernels.cu). One thread block cluster per batch
// element does all of one call in one launch (one block at decode sizes, up to 8 at prefill sizes), where XLA
// needed ~20 launches for the same arithmetic. Needs sm_90. Each launcher returns the launch's error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/moe/moe_routing.h"

namespace jax_ncclx {

// Bytes of device scratch LaunchPlanSends needs: an int32 per (batch element, member, token).
int64_t PlanSendsScratchBytes(const PlanSendsShape& shape);

// expert_ids: [B, T, k] int32; weights: [B, T, k] float32 when shape.with_weights, else null. Requires
// E <= kMaxRoutingExperts and every index below 2^31.
cudaError_t LaunchPlanSends(const PlanSendsShape& shape, const int32_t* expert_ids, const float* weights,
                            const PlanSendsResults& results, int32_t* scratch, cudaStream_t stream);

// received: [B, N * R, row_bytes], the exchange's rows with their suffixes at shape.suffix_offset; recv_tokens:
// [B, N] rows each source delivered.
cudaError_t LaunchPlaceReceived(const PlaceReceivedShape& shape, const uint8_t* received, const int32_t* recv_tokens,
                                const PlaceReceivedResults& results, cudaStream_t stream);

}  // namespace jax_ncclx
