// CPU handlers of the dense collectives (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute).
// Each participant reads its peers' operands in place through the rendezvous and writes only its own output.
// Reductions visit ranks in order 0..N-1, so every participant computes bit-identical results; 16-bit
// floats are accumulated in float32 and rounded once.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"
#include "ops/collectives/collective_checks.h"
#include "common/cpu_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = (bits >> 15) & 1, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

uint16_t FloatToHalf(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return sign | 0x7e00;
  float magnitude = std::fabs(value);
  if (magnitude >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (magnitude < std::ldexp(1.0f, -14)) {           // subnormal: a multiple of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(magnitude, 24)));
  }
  int exponent;
  const float fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent
  uint32_t mantissa = static_cast<uint32_t>(std::nearbyint(std::ldexp(fraction, 11)));  // 1024..2048
  if (mantissa == 2048) {
    mantissa = 1024;
    ++exponent;
  }
  if (exponent + 14 >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((exponent + 14) << 10) | (mantissa & 0x3ff));
}

template <typename Acc>
Acc Combine(ReduceOp op, Acc a, Acc b) {
  switch (op) {
    case ReduceOp::kSum:
      return a + b;
    case ReduceOp::kMax:
      return a > b ? a : b;
    case ReduceOp::kMin:
      return a < b ? a : b;
  }
  return a;
}

// out[i] = op over ranks of inputs[rank][offset + i]. Storage is the element type, Acc the accumulator.
template <typename Storage, typename Acc, Acc (*Load)(Storage), Storage (*Store)(Acc)>
void ReduceTyped(ReduceOp op, void* out, const std::vector<Published>& inputs, size_t offset, size_t count) {
  Storage* y = static_cast<Storage*>(out);
  for (size_t i = 0; i < count; ++i) {
    Acc acc = Load(static_cast<const Storage*>(inputs[0].data)[offset + i]);
    for (size_t r = 1; r < inputs.size(); ++r) {
      acc = Combine(op, acc, Load(static_cast<const Storage*>(inputs[r].data)[offset + i]));
    }
    y[i] = Store(acc);
  }
}

template <typename T>
T Identity(T value) {
  return value;
}

ffi::Error Reduce(std::string_view op_name, ffi::DataType dtype, ReduceOp op, void* out,
                  const std::vector<Published>& inputs, size_t offset, size_t count) {
  switch (dtype) {
#define NCCLX_REDUCE_CASE(DTYPE, T)                                              \
  case ffi::DataType::DTYPE:                                                     \
    ReduceTyped<T, T, Identity<T>, Identity<T>>(op, out, inputs, offset, count); \
    return ffi::Error::Success();
    NCCLX_REDUCE_CASE(F32, float)
    NCCLX_REDUCE_CASE(F64, double)
    NCCLX_REDUCE_CASE(S8, int8_t)
    NCCLX_REDUCE_CASE(U8, uint8_t)
    NCCLX_REDUCE_CASE(S16, int16_t)
    NCCLX_REDUCE_CASE(U16, uint16_t)
    NCCLX_REDUCE_CASE(S32, int32_t)
    NCCLX_REDUCE_CASE(U32, uint32_t)
    NCCLX_REDUCE_CASE(S64, int64_t)
    NCCLX_REDUCE_CASE(U64, uint64_t)
#undef NCCLX_REDUCE_CASE
    case ffi::DataType::BF16:
      ReduceTyped<uint16_t, float, Bf16ToFloat, FloatToBf16>(op, out, inputs, offset, count);
      return ffi::Error::Success();
    case ffi::DataType::F16:
      ReduceTyped<uint16_t, float, HalfToFloat, FloatToHalf>(op, out, inputs, offset, count);
      return ffi::Error::Success();
    default:
      return InvalidArgument(op_name, "cannot reduce dtype " + std::string(DataTypeName(dtype)));
  }
}

// The handlers return a pending future while their peers have not all arrived (common/rendezvous.h); the
// work they pass captures buffer pointers and sizes by value, as it may run after they have returned.

ffi::Future AllReduceImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> groups, int64_t group_size,
                          RawCallAttrs call_attrs, ReduceOp reduce_op) {
  constexpr std::string_view kOp = "all_reduce";
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<ReducedDtype> reduced = GetReducedDtype(kOp, x.element_type(), reduce_op);
  if (reduced.has_error()) return CompletedFuture(reduced.error());
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckSameDtype(kOp, x, *y));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckSameBytes(kOp, x, *y));
  void* out = y->untyped_data();
  const size_t count = x.element_count() * reduced->per_element;
  return RunInGroup(kOp, run, instance, partition_id.typed_data()[0], groups, group_size, call_attrs,
                    {x.untyped_data()}, out, y->size_bytes(),
                    [reduced = *reduced, out, count](int64_t, const std::vector<Published>& peers) {
                      return Reduce(kOp, reduced.dtype, reduced.op, out, peers, 0, count);
                    });
}

ffi::Future AllGatherImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> groups, int64_t group_size,
                          RawCallAttrs call_attrs) {
  constexpr std::string_view kOp = "all_gather";
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  const size_t chunk = x.size_bytes();
  NCCLX_RETURN_FUTURE_IF_ERROR(
      CheckBytes(kOp, "output", Bytes(*y), group_size * Bytes(x), RanksTimes(group_size, Bytes(x))));
  char* out = static_cast<char*>(y->untyped_data());
  return RunInGroup(kOp, run, instance, partition_id.typed_data()[0], groups, group_size, call_attrs,
                    {x.untyped_data()}, out, y->size_bytes(),
                    [out, chunk](int64_t, const std::vector<Published>& peers) {
                      for (size_t r = 0; r < peers.size(); ++r) std::memcpy(out + r * chunk, peers[r].data, chunk);
                      return ffi::Error::Success();
                    });
}

ffi::Future ReduceScatterImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> groups, int64_t group_size,
                              RawCallAttrs call_attrs, ReduceOp reduce_op) {
  constexpr std::string_view kOp = "reduce_scatter";
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  ffi::ErrorOr<ReducedDtype> reduced = GetReducedDtype(kOp, x.element_type(), reduce_op);
  if (reduced.has_error()) return CompletedFuture(reduced.error());
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckSameDtype(kOp, x, *y));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckEvenSplit(kOp, Bytes(x), group_size));
  NCCLX_RETURN_FUTURE_IF_ERROR(
      CheckBytes(kOp, "input", Bytes(x), group_size * Bytes(*y), RanksTimes(group_size, Bytes(*y))));
  void* out = y->untyped_data();
  const size_t count = y->element_count() * reduced->per_element;
  return RunInGroup(kOp, run, instance, partition_id.typed_data()[0], groups, group_size, call_attrs,
                    {x.untyped_data()}, out, y->size_bytes(),
                    [reduced = *reduced, out, count](int64_t rank, const std::vector<Published>& peers) {
                      return Reduce(kOp, reduced.dtype, reduced.op, out, peers, rank * count, count);
                    });
}

ffi::Future AllToAllImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> groups, int64_t group_size,
                         RawCallAttrs call_attrs) {
  constexpr std::string_view kOp = "all_to_all";
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckEvenSplit(kOp, Bytes(x), group_size));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckSameBytes(kOp, x, *y));
  const size_t chunk = x.size_bytes() / group_size;
  char* out = static_cast<char*>(y->untyped_data());
  return RunInGroup(kOp, run, instance, partition_id.typed_data()[0], groups, group_size, call_attrs,
                    {x.untyped_data()}, out, y->size_bytes(),
                    [out, chunk](int64_t rank, const std::vector<Published>& peers) {
                      for (size_t r = 0; r < peers.size(); ++r) {
                        std::memcpy(out + r * chunk, static_cast<const char*>(peers[r].data) + rank * chunk, chunk);
                      }
                      return ffi::Error::Success();
                    });
}

ffi::Future PpermuteImpl(ffi::RunId run, CallInstance* instance, PartitionId partition_id, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> groups, int64_t group_size,
                         RawCallAttrs call_attrs, ffi::Span<const int64_t> sources, ffi::Span<const int64_t> targets) {
  constexpr std::string_view kOp = "ppermute";
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckWholeBytes(kOp, "x", x.element_type()));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckPairs(kOp, sources, targets, group_size));
  NCCLX_RETURN_FUTURE_IF_ERROR(CheckSameBytes(kOp, x, *y));
  void* out = y->untyped_data();
  const size_t bytes = y->size_bytes();
  return RunInGroup(kOp, run, instance, partition_id.typed_data()[0], groups, group_size, call_attrs,
                    {x.untyped_data()}, out, bytes,
                    [out, bytes,
                     sources = std::vector<int64_t>(sources.begin(),
                                                    sources.end())](int64_t rank, const std::vector<Published>& peers) {
                      const int64_t source = sources[rank];
                      if (source < 0) {
                        std::memset(out, 0, bytes);
                      } else {
                        std::memcpy(out, peers[source].data, bytes);
                      }
                      return ffi::Error::Success();
                    });
}

// Binding prefix shared by the single-operand collectives: run id and partition id, operand, result.
auto BindSingleOperand() {
  return BindCpuCollective()
      .Arg<ffi::AnyBuffer>()  // x
      .Ret<ffi::AnyBuffer>();  // y
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllReduce, AllReduceImpl,
                              BindCpuGroupAttrs(BindSingleOperand()).Attr<ReduceOp>("reduce_op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllGather, AllGatherImpl, BindCpuGroupAttrs(BindSingleOperand()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuReduceScatter, ReduceScatterImpl,
                              BindCpuGroupAttrs(BindSingleOperand()).Attr<ReduceOp>("reduce_op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllToAll, AllToAllImpl, BindCpuGroupAttrs(BindSingleOperand()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuPpermute, PpermuteImpl,
                              BindCpuGroupAttrs(BindSingleOperand())
                                  .Attr<ffi::Span<const int64_t>>("sources")    // source of each rank, -1: none
                                  .Attr<ffi::Span<const int64_t>>("targets"));  // target of each rank, -1: none

}  // namespace jax_ncclx
