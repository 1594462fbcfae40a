// What the Python half and the handlers must agree on, defined here once: the enums that FFI attributes carry,
// each with the name Python gives its values, and the limits the lowering checks before a handler would.
// Both native modules export it (contract(), contract_bindings.h) and jax_ncclx/_src/contract.py reads it
// from there, so Python holds no copy. Plain C++: host code, device code and the CPU module include it.
#pragma once

#include <cstdint>
#include <limits>

namespace jax_ncclx {

// Injected faults (monitor.h), as JAX_NCCLX_FAULT names them.
enum class FaultKind : int { kDelay = 0, kSkip = 1, kCorruptCounts = 2, kCorruptPayload = 3, kStall = 4 };

// The reductions of all_reduce and reduce_scatter, as their reduce_op attribute carries them.
enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2 };

// The algorithm attribute of the NVLink all_reduce; two-shot is all_reduce only.
enum class NvlinkAlgorithm : int { kOneShot = 1, kTwoShot = 2 };

// The protocol attribute: the one a one-shot call prefers (the segment may force simple). LL128 relies on
// NVLink delivering a warp's aligned 128-byte store whole, as NCCL's LL128 does; LL is the fallback for a
// platform where that does not hold.
enum class NvlinkProtocol : int { kLL128 = 0, kLL = 1, kSimple = 2 };

// The wire attribute of moe.dispatch: rows travel in tokens' dtype, or as 8-bit floats with a float32 scale
// per kMoeWireBlock values (the name is the dtype's).
enum class MoeWire : int { kNone = 0, kE4M3 = 1, kE5M2 = 2 };

// Values per scale on moe.dispatch's 8-bit wire.
constexpr int64_t kMoeWireBlock = 128;

// The largest finite value of an 8-bit wire format, which each block's scale maps its largest magnitude to.
constexpr float MoeWireLargest(MoeWire wire) { return wire == MoeWire::kE4M3 ? 448.0f : 57344.0f; }

// The float dtypes the MoE kernels convert and add: tokens on the 8-bit wire, combine's rows. Decoded from a
// buffer's dtype, not an attribute (the loopback module passes them by value); Python reads the list to route.
enum class FloatType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline int FloatTypeBytes(FloatType type) { return type == FloatType::kF32 ? 4 : 2; }

// The element types the NVLink all_reduce and reduce_scatter kernels reduce (16-bit floats accumulate in
// float32 and round once). Decoded from a buffer's dtype; Python reads the list to route.
enum class ReduceType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kS32 = 3 };

// Which NVLink kernel a device-side trace record or fault record comes from.
enum TraceKernel : uint32_t {
  kTraceAllToAllv = 1,
  kTraceAllReduce = 2,
  kTraceAllGather = 3,
  kTraceAllToAll = 4,
  kTraceReduceScatter = 5,
  kTraceMoeCombine = 6,
  kTraceMoeDispatch = 7,
  kTraceMoeMaskedDispatch = 8,
  kTraceMoeMaskedCombine = 9,
};

// Ranks one NVLink communicator may have (one host's NVLink domain).
constexpr int kMaxNvlinkRanks = 8;

// The largest capacity (rows or pairs per member) a handler takes: kernels index rows with int32.
inline constexpr int64_t kMaxCapacity = std::numeric_limits<int32_t>::max();

// The most experts the routing handles: the CUDA kernels keep per-expert counters in shared memory.
constexpr int64_t kMaxRoutingExperts = 2048;

// A value's name, for the tables Python reads.
struct Named {
  const char* name;
  int64_t value;
};

inline constexpr Named kFaultKindNames[] = {
    {"delay", static_cast<int64_t>(FaultKind::kDelay)},
    {"skip", static_cast<int64_t>(FaultKind::kSkip)},
    {"corrupt_counts", static_cast<int64_t>(FaultKind::kCorruptCounts)},
    {"corrupt_payload", static_cast<int64_t>(FaultKind::kCorruptPayload)},
    {"stall", static_cast<int64_t>(FaultKind::kStall)},
};
inline constexpr Named kReduceOpNames[] = {
    {"sum", static_cast<int64_t>(ReduceOp::kSum)},
    {"max", static_cast<int64_t>(ReduceOp::kMax)},
    {"min", static_cast<int64_t>(ReduceOp::kMin)},
};
inline constexpr Named kNvlinkAlgorithmNames[] = {
    {"one_shot", static_cast<int64_t>(NvlinkAlgorithm::kOneShot)},
    {"two_shot", static_cast<int64_t>(NvlinkAlgorithm::kTwoShot)},
};
inline constexpr Named kNvlinkProtocolNames[] = {
    {"ll128", static_cast<int64_t>(NvlinkProtocol::kLL128)},
    {"ll", static_cast<int64_t>(NvlinkProtocol::kLL)},
    {"simple", static_cast<int64_t>(NvlinkProtocol::kSimple)},
};
inline constexpr Named kMoeWireNames[] = {
    {"none", static_cast<int64_t>(MoeWire::kNone)},
    {"float8_e4m3fn", static_cast<int64_t>(MoeWire::kE4M3)},
    {"float8_e5m2", static_cast<int64_t>(MoeWire::kE5M2)},
};
inline constexpr Named kFloatTypeNames[] = {
    {"float32", static_cast<int64_t>(FloatType::kF32)},
    {"bfloat16", static_cast<int64_t>(FloatType::kBF16)},
    {"float16", static_cast<int64_t>(FloatType::kF16)},
};

inline constexpr Named kReduceTypeNames[] = {
    {"float32", static_cast<int64_t>(ReduceType::kF32)},
    {"bfloat16", static_cast<int64_t>(ReduceType::kBF16)},
    {"float16", static_cast<int64_t>(ReduceType::kF16)},
    {"int32", static_cast<int64_t>(ReduceType::kS32)},
};
inline constexpr Named kTraceKernelNames[] = {
    {"all_to_allv_dynamic", kTraceAllToAllv},
    {"all_reduce", kTraceAllReduce},
    {"all_gather", kTraceAllGather},
    {"all_to_all", kTraceAllToAll},
    {"reduce_scatter", kTraceReduceScatter},
    {"moe.combine", kTraceMoeCombine},
    {"moe.dispatch", kTraceMoeDispatch},
    {"moe.masked_dispatch", kTraceMoeMaskedDispatch},
    {"moe.masked_combine", kTraceMoeMaskedCombine},
};

}  // namespace jax_ncclx
