// CUDA handlers of the moe routing ops: decode, check, and launch one kernel (moe_routing_kernels.cu) on
// XLA's stream. No host work beyond the launch and no communicator, so both are safe in command buffers.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "common/checks.h"
#include "common/nccl_comms.h"
#include "ops/moe/moe_routing_checks.h"
#include "ops/moe/moe_routing_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

ffi::Error PlanSendsImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> expert_ids,
                         std::optional<ffi::Buffer<ffi::F32>> weights, Int32Result order, Int32Result send_counts,
                         Int32Result send_token, Int32Result send_suffix, Int32Result token_counts,
                         Int32Result return_slot, Int32Result return_row, Int32Result dropped,
                         ffi::Result<ffi::AnyBuffer> scratch, PlanSendsAttrs attrs) {
  ffi::ErrorOr<PlanSendsShape> shape = GetPlanSendsShape(expert_ids, weights, attrs);
  if (shape.has_error()) return shape.error();
  NCCLX_RETURN_IF_ERROR(CheckPlanSendsResults(*shape, order, send_counts, send_token, send_suffix, token_counts,
                                              return_slot, return_row, dropped));
  NCCLX_RETURN_IF_ERROR(CheckDims(kPlanSendsOp, "scratch", scratch->dimensions(), {PlanSendsScratchBytes(*shape)}));
  return CheckCuda(kPlanSendsOp, "kernel launch",
                   LaunchPlanSends(*shape, expert_ids.typed_data(), weights ? weights->typed_data() : nullptr,
                                   PlanSendsData(order, send_counts, send_token, send_suffix, token_counts, return_slot,
                                                 return_row, dropped),
                                   static_cast<int32_t*>(scratch->untyped_data()), stream));
}

ffi::Error PlaceReceivedImpl(cudaStream_t stream, ffi::AnyBuffer received, ffi::Buffer<ffi::S32> recv_tokens,
                             Int32Result recv_counts, Int32Result group_sizes, Int32Result expand_rows,
                             Int32Result to_expert_major, Int32Result to_source_major, Int32Result pair_entry,
                             Int32Result row_pairs, Int32Result send_back_rows, Float32Result recv_weights,
                             PlaceReceivedAttrs attrs) {
  ffi::ErrorOr<PlaceReceivedShape> shape = GetPlaceReceivedShape(received, recv_tokens, attrs);
  if (shape.has_error()) return shape.error();
  NCCLX_RETURN_IF_ERROR(CheckPlaceReceivedResults(*shape, recv_counts, group_sizes, expand_rows, to_expert_major,
                                                  to_source_major, pair_entry, row_pairs, send_back_rows,
                                                  recv_weights));
  return CheckCuda(kPlaceReceivedOp, "kernel launch",
                   LaunchPlaceReceived(*shape, static_cast<const uint8_t*>(received.untyped_data()),
                                       recv_tokens.typed_data(),
                                       PlaceReceivedData(recv_counts, group_sizes, expand_rows, to_expert_major,
                                                         to_source_major, pair_entry, row_pairs, send_back_rows,
                                                         recv_weights),
                                       stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CudaMoePlanSends, PlanSendsImpl,
    BindPlanSendsAttrs(BindPlanSendsBuffers(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                           .Ret<ffi::AnyBuffer>()),  // scratch (PlanSendsScratchBytes)
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaMoePlaceReceived, PlaceReceivedImpl,
                              BindPlaceReceived(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ncclx
