// CPU handler of take_rows: one memcpy per row part.
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops/take_rows/take_rows.h"
#include "ops/take_rows/take_rows_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

ffi::Error TakeRowsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, std::optional<ffi::AnyBuffer> suffix,
                        ffi::Result<ffi::AnyBuffer> out) {
  ffi::ErrorOr<TakeRowsShape> shape = GetTakeRowsShape(x, index, suffix, *out);
  if (shape.has_error()) return shape.error();
  const TakeRowsShape& s = *shape;
  const auto* rows = static_cast<const uint8_t*>(x.untyped_data());
  const auto* tails = static_cast<const uint8_t*>(OptionalData(suffix));
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.rows; ++i, dst += s.out_row_bytes()) {
      const int64_t row = index.typed_data()[b * s.rows + i];
      if (row >= 0 && row < s.source_rows) {
        std::memcpy(dst, rows + (b * s.source_rows + row) * s.x_row_bytes, s.take_bytes);
      } else {
        std::memset(dst, 0, s.take_bytes);
      }
      if (tails != nullptr) std::memcpy(dst + s.take_bytes, tails + (b * s.rows + i) * s.suffix_bytes, s.suffix_bytes);
    }
  }
  return ffi::Error::Success();
}

// The CUDA kernel's walk: zeros where the index is out of range, then each row of x to the rows sources lists.
ffi::Error ExpandRowsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> sources,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto shape = GetExpandRowsShape(x, index, sources, *out);
  if (shape.has_error()) return shape.error();
  const auto& [s, top_k] = *shape;
  const auto* rows = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t o = 0; o < s.batch * s.rows; ++o) {
    const int64_t row = index.typed_data()[o];
    if (row < 0 || row >= s.source_rows) std::memset(dst + o * s.take_bytes, 0, s.take_bytes);
  }
  for (int64_t r = 0; r < s.batch * s.source_rows; ++r) {
    const int64_t b = r / s.source_rows;
    for (int32_t j = 0; j < top_k; ++j) {
      const int64_t to = sources.typed_data()[r * top_k + j];
      if (to >= 0 && to < s.rows)
        std::memcpy(dst + (b * s.rows + to) * s.take_bytes, rows + r * s.x_row_bytes, s.take_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuExpandRows, ExpandRowsImpl, BindExpandRows(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuTakeRows, TakeRowsImpl, BindTakeRows(ffi::Ffi::Bind()));

}  // namespace jax_ncclx
