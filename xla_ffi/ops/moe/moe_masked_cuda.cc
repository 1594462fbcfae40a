// CUDA FFI handlers of the masked layout's NVLink kernels (moe_masked.h): each checks the operands and results
// against each other and the kernel's limits, finds this rank's symmetric memory and queues its kernel on XLA's
// stream. Their arguments are fixed for the program (peer addresses come from the stable peer table, epochs
// live on the device), so they are safe inside command buffers; the Python lowering sizes the slots before the
// program can run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/contract_attrs.h"
#include "common/cuda_collective.h"
#include "common/monitor.h"
#include "common/nccl_comms.h"
#include "common/symmetric.h"
#include "common/watchdog.h"
#include "ops/moe/moe_dispatch.h"
#include "ops/moe/moe_dispatch_checks.h"
#include "ops/moe/moe_masked.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

// The masked dispatch's `dispatch` attribute, a dictionary (moe_masked.py).
struct MoeMaskedDispatchAttrs {
  int64_t num_experts = 0;        // E
  int64_t capacity = 0;           // C: kept pairs per (local expert, source member)
  MoeWire wire = MoeWire::kNone;  // how rows travel (contract.h)
};

}  // namespace jax_ncclx

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::MoeMaskedDispatchAttrs,
                                      ::xla::ffi::StructMember<int64_t>("num_experts"),
                                      ::xla::ffi::StructMember<int64_t>("capacity"),
                                      ::xla::ffi::StructMember<jax_ncclx::MoeWire>("wire"));

namespace jax_ncclx {
namespace {

constexpr std::string_view kDispatchOp = "moe.masked_dispatch";
constexpr std::string_view kCombineOp = "moe.masked_combine";

ffi::Error MoeMaskedDispatchImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer tokens,
                                 ffi::AnyBuffer expert_ids, ffi::RemainingArgs weights_arg,
                                 ffi::Result<ffi::AnyBuffer> expert_rows, ffi::Result<ffi::AnyBuffer> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> send_pairs, ffi::Result<ffi::AnyBuffer> pair_slot,
                                 ffi::Result<ffi::AnyBuffer> send_counts, ffi::Result<ffi::AnyBuffer> dropped,
                                 ffi::Result<ffi::AnyBuffer> recv_counts, ffi::Result<ffi::AnyBuffer> row_pair,
                                 ffi::Result<ffi::AnyBuffer> recv_weights, ffi::Result<ffi::AnyBuffer> recv_tokens,
                                 ffi::Result<ffi::AnyBuffer> choice_rows, ffi::Result<ffi::AnyBuffer> choice_weights,
                                 ffi::Result<ffi::AnyBuffer> send_back_rows, ffi::Result<ffi::AnyBuffer> return_row,
                                 int64_t comm_id, RawCallAttrs call_attrs, MoeMaskedDispatchAttrs dispatch,
                                 int64_t blocks) {
  constexpr std::string_view kOp = kDispatchOp;
  const CallAttrs attrs = MakeCallAttrs(call_attrs);
  const int64_t num_experts = dispatch.num_experts, capacity = dispatch.capacity;
  const MoeWire wire = dispatch.wire;
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  const int64_t n = symmetric->size;
  ffi::ErrorOr<DispatchOperands> read = ReadDispatchOperands(kOp, tokens, expert_ids, weights_arg, wire,
                                                             /*float_tokens=*/true);
  if (read.has_error()) return read.error();
  const int64_t T = read->tokens, H = read->hidden, k = read->top_k;
  const bool with_weights = read->weights != nullptr;
  if (num_experts < 1 || num_experts % n != 0 || num_experts > kMaxRoutingExperts || capacity < 1 ||
      capacity > kMaxCapacity / num_experts) {
    return InvalidArgument(kOp, "num_experts " + std::to_string(num_experts) +
                                    " must be a multiple of N = " + std::to_string(n) + " up to " +
                                    std::to_string(kMaxRoutingExperts) + ", and num_experts * capacity (capacity " +
                                    std::to_string(capacity) + ") from 1 to " + std::to_string(kMaxCapacity));
  }
  if (k < 1 || k > kMaxMoeMaskedTopK || T * k > kMaxMoeMaskedPairs || read->row_bytes % 16 != 0) {
    return InvalidArgument(kOp, "the NVLink kernel takes top-k 1 to " + std::to_string(kMaxMoeMaskedTopK) +
                                    ", at most " + std::to_string(kMaxMoeMaskedPairs) +
                                    " pairs (T * k) and rows of a multiple of 16 bytes; got T = " + std::to_string(T) +
                                    ", k = " + std::to_string(k) + ", rows of " + std::to_string(read->row_bytes) +
                                    " bytes (larger calls take the chain)");
  }
  const int64_t L = num_experts / n, NC = n * capacity, P = T * k, R = std::min(T, L * capacity);
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "expert_rows", *expert_rows, tokens.element_type(), {L, NC, H}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "group_sizes", *group_sizes, ffi::S32, {L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_pairs", *send_pairs, ffi::S32, {P}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "pair_slot", *pair_slot, ffi::S32, {P}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_counts", *send_counts, ffi::S32, {n, L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "dropped", *dropped, ffi::S32, {n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_counts", *recv_counts, ffi::S32, {n, L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "row_pair", *row_pair, ffi::S32, {L, NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_weights", *recv_weights, ffi::F32, {L, with_weights ? NC : 0}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_tokens", *recv_tokens, ffi::S32, {n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "choice_rows", *choice_rows, ffi::S32, {n * R, k}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "choice_weights", *choice_weights, ffi::F32, {n * R, with_weights ? k : 0}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_back_rows", *send_back_rows, ffi::S32, {n * R}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "return_row", *return_row, ffi::S32, {T, n}));
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(kOp, comm_id, *symmetric));

  MoeMaskedDispatchArgs args;
  args.rank = symmetric->rank;
  args.size = static_cast<int>(n);
  args.top_k = static_cast<int>(k);
  args.tokens = T;
  args.num_experts = num_experts;
  args.capacity = capacity;
  args.row_bytes = read->row_bytes;
  args.wire = wire;
  args.token_type = read->token_type;
  args.wire_row_bytes = read->wire_row_bytes;
  args.with_weights = with_weights;
  args.trace = attrs.trace_device;
  args.site = attrs.site;
  args.timeout_ns = static_cast<uint64_t>(attrs.timeout_ms) * 1000000;
  args.tokens_in = tokens.untyped_data();
  args.expert_ids = static_cast<const int32_t*>(expert_ids.untyped_data());
  args.weights = read->weights;
  args.expert_rows = expert_rows->untyped_data();
  args.group_sizes = Ints(group_sizes);
  args.send_pairs = Ints(send_pairs);
  args.pair_slot = Ints(pair_slot);
  args.send_counts = Ints(send_counts);
  args.dropped = Ints(dropped);
  args.recv_counts = Ints(recv_counts);
  args.row_pair = Ints(row_pair);
  args.recv_weights = static_cast<float*>(recv_weights->untyped_data());
  args.recv_tokens = Ints(recv_tokens);
  args.choice_rows = Ints(choice_rows);
  args.choice_weights = static_cast<float*>(choice_weights->untyped_data());
  args.send_back_rows = Ints(send_back_rows);
  args.return_row = Ints(return_row);
  args.table = symmetric->table;
  args.control = symmetric->control;
  NCCLX_RETURN_IF_ERROR(
      CheckSlots(kOp, MoeMaskedDispatchSlotBytes(args.size, args.tokens, L, capacity, args.wire, args.wire_row_bytes),
                 *symmetric));
  ffi::ErrorOr<int> sm_count = SmCount(kOp, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  const int grid = ChooseMoeMaskedDispatchBlocks(args, RequestedBlocks(blocks), *sm_count);
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(kOp, attrs, comm_id, symmetric->rank, args.size, device_ordinal, stream);
  if (call.has_error()) return call.error();
  return RunGpuCall(*call, /*watch=*/false, args.expert_rows, L * NC * args.row_bytes, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(kOp, stream));
    return CheckCuda(kOp, "NVLink kernel launch", LaunchMoeMaskedDispatch(args, grid, stream));
  });
}

ffi::Error MoeMaskedCombineImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer expert_out,
                                ffi::AnyBuffer row_pair, ffi::AnyBuffer pair_slot, ffi::AnyBuffer weights,
                                ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, RawCallAttrs call_attrs,
                                int64_t blocks) {
  constexpr std::string_view kOp = kCombineOp;
  const CallAttrs attrs = MakeCallAttrs(call_attrs);
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  const int64_t n = symmetric->size;
  const std::optional<FloatType> type = FloatTypeOf(expert_out.element_type());
  if (!type.has_value()) {
    return InvalidArgument(kOp, "the NVLink kernel takes expert_out of f32, bf16 or f16, got " +
                                    std::string(DataTypeName(expert_out.element_type())) + " (others take the chain)");
  }
  const auto expert_dims = expert_out.dimensions();
  const auto slot_dims = pair_slot.dimensions();
  const auto out_dims = out->dimensions();
  if (expert_dims.size() != 3 || slot_dims.size() != 1 || out_dims.size() != 2 || expert_dims[1] % n != 0) {
    return InvalidArgument(kOp, "expert_out must be [L, N * C, H'], pair_slot [T * k] and out [T, H'] with N = " +
                                    std::to_string(n) + ", got " + DimsString(expert_dims) + ", " +
                                    DimsString(slot_dims) + " and " + DimsString(out_dims));
  }
  const int64_t L = expert_dims[0], NC = expert_dims[1], hidden = expert_dims[2];
  const int64_t P = slot_dims[0], T = out_dims[0];
  if ((T == 0 && P != 0) || (T > 0 && P % T != 0)) {
    return InvalidArgument(kOp, "pair_slot has " + std::to_string(P) +
                                    " pairs, expected a multiple of T = " + std::to_string(T) + " (out's rows)");
  }
  const int64_t k = T > 0 ? P / T : 1;
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "out", *out, expert_out.element_type(), {T, hidden}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "row_pair", row_pair, ffi::S32, {L, NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "pair_slot", pair_slot, ffi::S32, {P}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "weights", weights, ffi::F32, {T, k}));
  const int64_t element_bytes = ffi::ByteWidth(expert_out.element_type());
  if (k < 1 || k > kMaxMoeMaskedTopK || P > kMaxMoeMaskedPairs || (hidden * element_bytes) % 16 != 0 ||
      (L > 0 && NC > kMaxCapacity / L)) {
    return InvalidArgument(kOp, "the NVLink kernel takes top-k 1 to " + std::to_string(kMaxMoeMaskedTopK) +
                                    ", at most " + std::to_string(kMaxMoeMaskedPairs) +
                                    " pairs (T * k), L * N * C rows up to " + std::to_string(kMaxCapacity) +
                                    " and rows of a multiple of 16 bytes; got T = " + std::to_string(T) +
                                    ", k = " + std::to_string(k) + ", L = " + std::to_string(L) +
                                    ", N * C = " + std::to_string(NC) + ", rows of " +
                                    std::to_string(hidden * element_bytes) + " bytes (larger calls take the chain)");
  }
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(kOp, comm_id, *symmetric));

  MoeMaskedCombineArgs args;
  args.type = *type;
  args.rank = symmetric->rank;
  args.size = static_cast<int>(n);
  args.top_k = static_cast<int>(k);
  args.local_experts = L;
  args.expert_rows = NC;
  args.tokens = T;
  args.hidden = hidden;
  args.trace = attrs.trace_device;
  args.site = attrs.site;
  args.timeout_ns = static_cast<uint64_t>(attrs.timeout_ms) * 1000000;
  args.expert_out = expert_out.untyped_data();
  args.row_pair = static_cast<const int32_t*>(row_pair.untyped_data());
  args.pair_slot = static_cast<const int32_t*>(pair_slot.untyped_data());
  args.weights = static_cast<const float*>(weights.untyped_data());
  args.out = out->untyped_data();
  args.table = symmetric->table;
  args.control = symmetric->control;
  NCCLX_RETURN_IF_ERROR(
      CheckSlots(kOp, MoeMaskedCombineSlotBytes(P, hidden, static_cast<int>(element_bytes)), *symmetric));
  // The same on every rank: nothing to send or to write, so no call at all.
  if (hidden == 0 || T == 0) return ffi::Error::Success();
  ffi::ErrorOr<int> sm_count = SmCount(kOp, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  const int grid = ChooseMoeMaskedCombineBlocks(args, RequestedBlocks(blocks), *sm_count);
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(kOp, attrs, comm_id, symmetric->rank, args.size, device_ordinal, stream);
  if (call.has_error()) return call.error();
  return RunGpuCall(*call, /*watch=*/false, args.out, T * hidden * element_bytes, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(kOp, stream));
    return CheckCuda(kOp, "NVLink kernel launch", LaunchMoeMaskedCombine(args, grid, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkMoeMaskedDispatch, MoeMaskedDispatchImpl,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                                .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
                                                .Arg<ffi::AnyBuffer>()   // tokens [T, H] f32/bf16/f16
                                                .Arg<ffi::AnyBuffer>()   // expert_ids s32 [T, k]
                                                .RemainingArgs()         // weights f32 [T, k], or none
                                                .Ret<ffi::AnyBuffer>()   // expert_rows [L, N * C, H], tokens' dtype
                                                .Ret<ffi::AnyBuffer>()   // group_sizes s32 [L]
                                                .Ret<ffi::AnyBuffer>()   // send_pairs s32 [T * k]
                                                .Ret<ffi::AnyBuffer>()   // pair_slot s32 [T * k]
                                                .Ret<ffi::AnyBuffer>()   // send_counts s32 [N, L]
                                                .Ret<ffi::AnyBuffer>()   // dropped s32 [N]
                                                .Ret<ffi::AnyBuffer>()   // recv_counts s32 [N, L]
                                                .Ret<ffi::AnyBuffer>()   // row_pair s32 [L, N * C]
                                                .Ret<ffi::AnyBuffer>()   // recv_weights f32 [L, N * C or 0]
                                                .Ret<ffi::AnyBuffer>()   // recv_tokens s32 [N]
                                                .Ret<ffi::AnyBuffer>()   // choice_rows s32 [N * R, k]
                                                .Ret<ffi::AnyBuffer>()   // choice_weights f32 [N * R, k or 0]
                                                .Ret<ffi::AnyBuffer>()   // send_back_rows s32 [N * R]
                                                .Ret<ffi::AnyBuffer>()   // return_row s32 [T, N]
                                                .Attr<int64_t>("comm_id"))
                                  .Attr<MoeMaskedDispatchAttrs>("dispatch")
                                  .Attr<int64_t>("blocks"),  // 0 = by size
                              {ffi::Traits::kCmdBufferCompatible});

NCCLX_DEFINE_PREPARE_HANDLER(NvlinkMoeMaskedDispatchPrepare, "moe.masked_dispatch");

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkMoeMaskedCombine, MoeMaskedCombineImpl,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                                .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
                                                .Arg<ffi::AnyBuffer>()  // expert_out [L, N * C, H'] f32/bf16/f16
                                                .Arg<ffi::AnyBuffer>()  // row_pair s32 [L, N * C]
                                                .Arg<ffi::AnyBuffer>()  // pair_slot s32 [T * k]
                                                .Arg<ffi::AnyBuffer>()  // weights f32 [T, k]
                                                .Ret<ffi::AnyBuffer>()  // out [T, H'], expert_out's dtype
                                                .Attr<int64_t>("comm_id"))
                                  .Attr<int64_t>("blocks"),  // 0 = by size
                              {ffi::Traits::kCmdBufferCompatible});

NCCLX_DEFINE_PREPARE_HANDLER(NvlinkMoeMaskedCombinePrepare, "moe.masked_combine");

}  // namespace jax_ncclx
