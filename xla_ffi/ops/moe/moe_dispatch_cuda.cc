// CUDA FFI handler of moe.dispatch's NVLink kernel (moe_dispatch.h): checks the operands and results against
// each other, finds this rank's symmetric memory and queues the kernel on XLA's stream. Like the combine
// kernel's, its arguments are fixed for the program, so it is safe inside command buffers; the Python lowering
// sizes the slots before the program can run.
#include <cuda_runtime.h>

#include <cstdint>
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
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {

// moe.dispatch's `dispatch` attribute, a dictionary (moe_dispatch.py).
struct MoeDispatchAttrs {
  int64_t num_experts = 0;          // E
  int64_t capacity = 0;             // C: pairs each member takes from this one
  MoeWire wire = MoeWire::kNone;    // how rows travel (contract.h)
};

}  // namespace jax_ncclx

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ncclx::MoeDispatchAttrs, ::xla::ffi::StructMember<int64_t>("num_experts"),
                                      ::xla::ffi::StructMember<int64_t>("capacity"),
                                      ::xla::ffi::StructMember<jax_ncclx::MoeWire>("wire"));

namespace jax_ncclx {
namespace {

constexpr std::string_view kOp = "moe.dispatch";

ffi::Error MoeDispatchImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer tokens,
                           ffi::AnyBuffer expert_ids, ffi::RemainingArgs weights_arg,
                           ffi::Result<ffi::AnyBuffer> expert_rows, ffi::Result<ffi::AnyBuffer> group_sizes,
                           ffi::Result<ffi::AnyBuffer> order, ffi::Result<ffi::AnyBuffer> send_counts,
                           ffi::Result<ffi::AnyBuffer> recv_counts, ffi::Result<ffi::AnyBuffer> to_expert_major,
                           ffi::Result<ffi::AnyBuffer> to_source_major, ffi::Result<ffi::AnyBuffer> return_slot,
                           ffi::Result<ffi::AnyBuffer> dropped, ffi::Result<ffi::AnyBuffer> send_token,
                           ffi::Result<ffi::AnyBuffer> token_counts, ffi::Result<ffi::AnyBuffer> return_row,
                           ffi::Result<ffi::AnyBuffer> recv_tokens, ffi::Result<ffi::AnyBuffer> expand_rows,
                           ffi::Result<ffi::AnyBuffer> pair_entry, ffi::Result<ffi::AnyBuffer> row_pairs,
                           ffi::Result<ffi::AnyBuffer> send_back_rows, ffi::Result<ffi::AnyBuffer> recv_weights,
                           int64_t comm_id, RawCallAttrs call_attrs, MoeDispatchAttrs dispatch, int64_t blocks) {
  const CallAttrs attrs = MakeCallAttrs(call_attrs);
  const int64_t num_experts = dispatch.num_experts, capacity = dispatch.capacity;
  const MoeWire wire = dispatch.wire;
  ffi::ErrorOr<SymmetricRank> symmetric = LookupSymmetric(kOp, comm_id, device_ordinal);
  if (symmetric.has_error()) return symmetric.error();
  const int64_t n = symmetric->size;
  ffi::ErrorOr<DispatchOperands> read = ReadDispatchOperands(kOp, tokens, expert_ids, weights_arg, wire,
                                                             /*float_tokens=*/false);
  if (read.has_error()) return read.error();
  const int64_t T = read->tokens, H = read->hidden, k = read->top_k;
  if (num_experts < 1 || num_experts % n != 0 || num_experts > kMaxRoutingExperts || capacity < 1 ||
      n * capacity > kMaxCapacity) {
    return InvalidArgument(kOp, "num_experts " + std::to_string(num_experts) +
                                    " must be a multiple of N = " + std::to_string(n) + " up to " +
                                    std::to_string(kMaxRoutingExperts) + ", and N * capacity (capacity " +
                                    std::to_string(capacity) + ") at most " + std::to_string(kMaxCapacity));
  }
  if (k < 1 || k > kMaxMoeDispatchTopK || T * k > kMaxMoeDispatchPairs || n * T > kMaxMoeDispatchMemberTokens ||
      read->row_bytes % 16 != 0) {
    return InvalidArgument(kOp, "the NVLink kernel takes top-k 1 to " + std::to_string(kMaxMoeDispatchTopK) +
                                    ", at most " + std::to_string(kMaxMoeDispatchPairs) + " pairs and " +
                                    std::to_string(kMaxMoeDispatchMemberTokens) +
                                    " (member, token) pairs, and rows of a multiple of 16 bytes; got T = " +
                                    std::to_string(T) + ", k = " + std::to_string(k) + ", rows of " +
                                    std::to_string(read->row_bytes) + " bytes (larger calls take the chain)");
  }
  MoeDispatchArgs args;
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
  args.with_weights = read->weights != nullptr;
  const PlanSendsShape shape = args.plan_shape();
  const int64_t L = num_experts / n, NC = n * capacity, R = shape.rows_per_member(), S = shape.num_rows();
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "expert_rows", *expert_rows, tokens.element_type(), {NC, H}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "group_sizes", *group_sizes, ffi::S32, {L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "order", *order, ffi::S32, {T * k}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_counts", *send_counts, ffi::S32, {n, L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_counts", *recv_counts, ffi::S32, {n, L}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "to_expert_major", *to_expert_major, ffi::S32, {NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "to_source_major", *to_source_major, ffi::S32, {NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "return_slot", *return_slot, ffi::S32, {T * k}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "dropped", *dropped, ffi::S32, {n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_token", *send_token, ffi::S32, {S}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "token_counts", *token_counts, ffi::S32, {n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "return_row", *return_row, ffi::S32, {T, n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_tokens", *recv_tokens, ffi::S32, {n}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "expand_rows", *expand_rows, ffi::S32, {NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "pair_entry", *pair_entry, ffi::S32, {NC}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "row_pairs", *row_pairs, ffi::S32, {n * R, k}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "send_back_rows", *send_back_rows, ffi::S32, {n * R}));
  NCCLX_RETURN_IF_ERROR(CheckBuffer(kOp, "recv_weights", *recv_weights, ffi::F32, {n * R, args.with_weights ? k : 0}));
  NCCLX_RETURN_IF_ERROR(CheckNvlinkFault(kOp, comm_id, *symmetric));

  args.trace = attrs.trace_device;
  args.site = attrs.site;
  args.timeout_ns = static_cast<uint64_t>(attrs.timeout_ms) * 1000000;
  args.tokens_in = tokens.untyped_data();
  args.expert_ids = static_cast<const int32_t*>(expert_ids.untyped_data());
  args.weights = read->weights;
  args.expert_rows = expert_rows->untyped_data();
  args.plan.order = Ints(order);
  args.plan.send_counts = Ints(send_counts);
  args.plan.send_token = Ints(send_token);
  args.plan.token_counts = Ints(token_counts);
  args.plan.return_slot = Ints(return_slot);
  args.plan.return_row = Ints(return_row);
  args.plan.dropped = Ints(dropped);
  args.recv_tokens = Ints(recv_tokens);
  args.placed.recv_counts = Ints(recv_counts);
  args.placed.group_sizes = Ints(group_sizes);
  args.placed.expand_rows = Ints(expand_rows);
  args.placed.to_expert_major = Ints(to_expert_major);
  args.placed.to_source_major = Ints(to_source_major);
  args.placed.pair_entry = Ints(pair_entry);
  args.placed.row_pairs = Ints(row_pairs);
  args.placed.send_back_rows = Ints(send_back_rows);
  args.placed.recv_weights = static_cast<float*>(recv_weights->untyped_data());
  args.table = symmetric->table;
  args.control = symmetric->control;
  NCCLX_RETURN_IF_ERROR(
      CheckSlots(kOp, MoeDispatchSlotBytes(args.size, R, args.top_k, args.wire, args.wire_row_bytes, args.with_weights),
                 *symmetric));
  ffi::ErrorOr<int> sm_count = SmCount(kOp, device_ordinal);
  if (sm_count.has_error()) return sm_count.error();
  const int grid = ChooseMoeDispatchBlocks(args, RequestedBlocks(blocks), *sm_count);
  ffi::ErrorOr<GpuCall> call = BeginGpuCall(kOp, attrs, comm_id, symmetric->rank, args.size, device_ordinal, stream);
  if (call.has_error()) return call.error();
  return RunGpuCall(*call, /*watch=*/false, args.expert_rows, NC * args.row_bytes, [&]() -> ffi::Error {
    NCCLX_RETURN_IF_ERROR(CountNvlinkLaunch(kOp, stream));
    return CheckCuda(kOp, "NVLink kernel launch", LaunchMoeDispatch(args, grid, stream));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvlinkMoeDispatch, MoeDispatchImpl,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                                .Ctx<ffi::DeviceOrdinal>()                 // device_ordinal
                                                .Arg<ffi::AnyBuffer>()   // tokens [T, H]
                                                .Arg<ffi::AnyBuffer>()   // expert_ids s32 [T, k]
                                                .RemainingArgs()         // weights f32 [T, k], or none
                                                .Ret<ffi::AnyBuffer>()   // expert_rows [N * C, H], tokens' dtype
                                                .Ret<ffi::AnyBuffer>()   // group_sizes s32 [E_local]
                                                .Ret<ffi::AnyBuffer>()   // order s32 [T * k]
                                                .Ret<ffi::AnyBuffer>()   // send_counts s32 [N, E_local]
                                                .Ret<ffi::AnyBuffer>()   // recv_counts s32 [N, E_local]
                                                .Ret<ffi::AnyBuffer>()   // to_expert_major s32 [N * C]
                                                .Ret<ffi::AnyBuffer>()   // to_source_major s32 [N * C]
                                                .Ret<ffi::AnyBuffer>()   // return_slot s32 [T * k]
                                                .Ret<ffi::AnyBuffer>()   // dropped s32 [N]
                                                .Ret<ffi::AnyBuffer>()   // send_token s32 [S]
                                                .Ret<ffi::AnyBuffer>()   // token_counts s32 [N]
                                                .Ret<ffi::AnyBuffer>()   // return_row s32 [T, N]
                                                .Ret<ffi::AnyBuffer>()   // recv_tokens s32 [N]
                                                .Ret<ffi::AnyBuffer>()   // expand_rows s32 [N * C]
                                                .Ret<ffi::AnyBuffer>()   // pair_entry s32 [N * C]
                                                .Ret<ffi::AnyBuffer>()   // row_pairs s32 [N * R, k]
                                                .Ret<ffi::AnyBuffer>()   // send_back_rows s32 [N * R]
                                                .Ret<ffi::AnyBuffer>()   // recv_weights f32 [N * R, k or 0]
                                                .Attr<int64_t>("comm_id"))
                                  .Attr<MoeDispatchAttrs>("dispatch")
                                  .Attr<int64_t>("blocks"),  // 0 = by size
                              {ffi::Traits::kCmdBufferCompatible});

NCCLX_DEFINE_PREPARE_HANDLER(NvlinkMoeDispatchPrepare, "moe.dispatch");

}  // namespace jax_ncclx
