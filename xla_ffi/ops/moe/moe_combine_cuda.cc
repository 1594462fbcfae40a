// CUDA FFI handler of moe.combine's NVLink kernel (moe_combine.h): checks the operands against each other,
// finds this rank's symmetric memory and queues the kernel on XLA's stream. Its arguments are fixed for the
// program (peer addresses come from the stable peer table, epochs live on the device), so it is safe inside
// command buffers; the Python lowering sizes the slots before the program can run.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/symmetric.h"
#include "common/watchdog.h"
#include "common/cuda_collective.h"
#include "ops/moe/moe_combine.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

constexpr std::string_view kOp = "moe.combine";

ffi::ErrorOr<FloatType> GetType(ffi::DataType dtype) {
  if (std::optional<FloatType> type = FloatTypeOf(dtype)) return *type;
  return InvalidArgument(kOp, "the NVLink kernel takes expert_out of f32, bf16 or f16, got " +
                                  std::string(DataTypeName(dtype)) + " (others take the exchange chain)");
}

ffi::Error MoeCombineImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer expert_out,
                          ffi::AnyBuffer row_pairs, ffi::AnyBuffer weights, ffi::AnyBuffer recv_tokens,
                          ffi::AnyBuffer return_row, ffi::Result<ffi::AnyBuffer> out, int64_t comm_id,
                          RawCallAttrs call_attrs, int64_t blocks) {
  const CallAttrs attrs = MakeCallAttrs(call_attrs);
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  const int n = symmetric->size;
  ffi::ErrorOr<FloatType> type = GetType(expert_out.element_type());
  if (type.has_error()) return type.error();
  NCCLX_RETURN_IF_ERROR(CheckDtype(kOp, "out", *out, expert_out.element_type()));
  NCCLX_RETURN_IF_ERROR(CheckDtype(kOp, "row_pairs", row_pairs, ffi::S32));
  NCCLX_RETURN_IF_ERROR(CheckDtype(kOp, "weights", weights, ffi::F32));
  NCCLX_RETURN_IF_ERROR(CheckDtype(kOp, "recv_tokens", recv_tokens, ffi::S32));
  NCCLX_RETURN_IF_ERROR(CheckDtype(kOp, "return_row", return_row, ffi::S32));
  const auto expert_dims = expert_out.dimensions();
  const auto pair_dims = row_pairs.dimensions();
  const auto out_dims = out->dimensions();
  if (expert_dims.size() != 2 || pair_dims.size() != 2 || out_dims.size() != 2 || pair_dims[0] % n != 0) {
    return InvalidArgument(kOp, "expert_out must be [N * C, H'], row_pairs [N * R, k] and out [T, H'] with N = " +
                                    std::to_string(n) + ", got " + DimsString(expert_dims) + ", " +
                                    DimsString(pair_dims) + " and " + DimsString(out_dims));
  }
  const int64_t rows = pair_dims[0];
  const int64_t top_k = pair_dims[1];
  const int64_t tokens = out_dims[0];
  const int64_t hidden = expert_dims[1];
  NCCLX_RETURN_IF_ERROR(CheckDims(kOp, "weights", weights.dimensions(), {rows, top_k}));
  NCCLX_RETURN_IF_ERROR(CheckDims(kOp, "recv_tokens", recv_tokens.dimensions(), {n}));
  NCCLX_RETURN_IF_ERROR(CheckDims(kOp, "return_row", return_row.dimensions(), {tokens, n}));
  NCCLX_RETURN_IF_ERROR(CheckDims(kOp, "out", out_dims, {tokens, hidden}));
  if (top_k < 1 || top_k > kMaxMoeCombineTopK) {
    return InvalidArgument(kOp, "row_pairs has " + std::to_string(top_k) +
                                    " choices per row; the NVLink kernel takes 1 to " +
                                    std::to_string(kMaxMoeCombineTopK));
  }
  const int64_t element_bytes = ffi::ByteWidth(expert_out.element_type());
  if ((hidden * element_bytes) % 16 != 0) {
    return InvalidArgument(kOp, "rows of " + std::to_string(hidden * element_bytes) +
                                    " bytes; the NVLink kernel moves rows of a multiple of 16 bytes");
  }
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(kOp, comm_id, *symmetric));

  MoeCombineArgs args;
  args.type = *type;
  args.rank = symmetric->rank;
  args.size = n;
  args.top_k = static_cast<int>(top_k);
  args.rows_per_member = rows / n;
  args.expert_rows = expert_dims[0];
  args.tokens = tokens;
  args.hidden = hidden;
  args.trace = attrs.trace_device;
  args.site = attrs.site;
  args.timeout_ns = static_cast<uint64_t>(attrs.timeout_ms) * 1000000;
  args.expert_out = expert_out.untyped_data();
  args.row_pairs = static_cast<const int32_t*>(row_pairs.untyped_data());
  args.weights = static_cast<const float*>(weights.untyped_data());
  args.recv_tokens = static_cast<const int32_t*>(recv_tokens.untyped_data());
  args.return_row = static_cast<const int32_t*>(return_row.untyped_data());
  args.out = out->untyped_data();
  args.table = symmetric->table;
  args.control = symmetric->control;
  NCCLX_RETURN_IF_ERROR(
      CheckSlots(kOp, MoeCombineSlotBytes(n, args.rows_per_member, hidden, static_cast<int>(element_bytes)),
                 *symmetric));
  if (hidden == 0) return ffi::Error::Success();  // the same on every rank: no call at all
  ffi::ErrorOr<int> sm_count = SmCount(kOp, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  const int grid = ChooseMoeCombineBlocks(args, RequestedBlocks(blocks), *sm_count);
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(kOp, attrs, comm_id, symmetric->rank, n, device_ordinal, stream);
  if (call.has_error()) return call.error();
  return RunGpuCall(*call, /*watch=*/false, args.out, tokens * hidden * element_bytes, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(kOp, stream));
    return CheckCuda(kOp, "NVLink kernel launch", LaunchMoeCombine(args, grid, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkMoeCombine, MoeCombineImpl,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                                .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
                                                .Arg<ffi::AnyBuffer>()  // expert_out [N * C, H'] f32/bf16/f16
                                                .Arg<ffi::AnyBuffer>()  // row_pairs s32 [N * R, k]
                                                .Arg<ffi::AnyBuffer>()  // weights f32 [N * R, k]
                                                .Arg<ffi::AnyBuffer>()  // recv_tokens s32 [N]
                                                .Arg<ffi::AnyBuffer>()  // return_row s32 [T, N]
                                                .Ret<ffi::AnyBuffer>()  // out [T, H'], expert_out's dtype
                                                .Attr<int64_t>("comm_id"))
                                  .Attr<int64_t>("blocks"),  // 0 = by size
                              {ffi::Traits::kCmdBufferCompatible});

NCCLX_DEFINE_PREPARE_HANDLER(NvlinkMoeCombinePrepare, "moe.combine");

}  // namespace jax_ncclx
