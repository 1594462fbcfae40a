// The launch probe's FFI handler (ncclx_launch_probe): y = x through one small kernel, no communicator and no
// host work beyond the launch. It measures what any jax_ncclx custom call costs per op inside an XLA program
// (executor, command-buffer node, kernel launch), the floor under the small-message collectives' times.
#include <cuda_runtime.h>

#include <string>

#include "common/checks.h"
#include "common/nccl_comms.h"
#include "ops/launch_probe/launch_probe_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

constexpr std::string_view kOp = "launch_probe";

ffi::Error LaunchProbeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (x.size_bytes() != y->size_bytes()) {
    return InvalidArgument(kOp, "x has " + std::to_string(x.size_bytes()) + " bytes but y has " +
                                    std::to_string(y->size_bytes()));
  }
  if (x.size_bytes() == 0) return ffi::Error::Success();
  return CheckCuda(kOp, "probe kernel launch",
                   LaunchCopyProbe(x.untyped_data(), y->untyped_data(), static_cast<int64_t>(x.size_bytes()), stream));
}

}  // namespace

// Safe in command buffers, like the NVLink handlers: one kernel launch with fixed arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(LaunchProbe, LaunchProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x: any shape and dtype
                                  .Ret<ffi::AnyBuffer>(),                    // y: x's bytes
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ncclx
