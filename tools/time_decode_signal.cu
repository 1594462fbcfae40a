// What the signal between a dispatch's senders and its receivers costs at decode sizes, by scheme, on one GPU:
// every block of one kernel writes its share of R token rows into slots, signals, then waits until every
// block's share has landed and copies the rows out (as the NVLink MoE kernels' send, wait and expansion do, with
// one rank). A diagnostic for the decode kernels' design, not a benchmark (no XLA baseline; time the MoE layer
// with benchmarks/all_to_allv.py). Build and run from the repository root on a GPU machine:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ixla_ffi tools/time_decode_signal.cu -o /tmp/time_signal && /tmp/time_signal
//
// Schemes:
//   empty       the kernel with nothing in it: the launch floor of a call on a busy stream
//   local       rows written, then each block copies out only the rows it wrote itself: no signal at all (the
//               floor of the data movement; not a correct exchange)
//   flags.sys   rows stored plainly; each block: a barrier, then one st.release.sys flag; every block waits for
//               every block's flag (ld.acquire.sys), then copies its share out: the MoE kernels' scheme
//   flags.gpu   the same with gpu-scope release and acquire: what the fence costs when no peer GPU is involved
//               (not enough across GPUs)
//   lines       rows as LL128 lines (120 payload bytes and the call's epoch in each 128-byte line, stored as one
//               16-byte access per lane, 8 lanes a line); the reader polls each line until its epoch is the
//               call's and copies the payload out: no fence, no flag (the small collectives' LL128 protocol)
// The grid is one block of 512 threads per SM, all resident at once (checked), as the flag wait needs. Each time
// is the mean µs per call over 200 back-to-back launches between two events (the launch gaps included, as in a
// program), the median of 9 such runs. The last call's output is checked against the rows; every payload word
// travels XORed with its call's epoch, so a wait that let a reader copy an earlier call's slots fails the check.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/device_sync.cuh"
#include "common/ll128_lines.cuh"
#include "ops/moe/moe_device.cuh"

namespace decode_signal {  // named: nvcc's kernel stubs cannot tell two anonymous namespaces apart

using jax_ncclx::kLanesPerLine;
using jax_ncclx::kLinePayloadWords;
using jax_ncclx::kLinesPerWarpStep;
using jax_ncclx::LoadVolatile;
using jax_ncclx::Pair64;
using jax_ncclx::StoreVolatile;

void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int64_t kRowBytes = 7168 * 2;  // hidden 7168 bf16, all_to_allv.py's rows
constexpr int64_t kRowVectors = kRowBytes / 16;
constexpr int64_t kRowWords = kRowBytes / 4;
constexpr int64_t kRowLines = jax_ncclx::LinesOf(kRowBytes);

// A wait this long has lost its writer (a bug here, or a block that never ran): the kernel traps.
constexpr uint64_t kMostWaitNs = 2'000'000'000;

enum class Scheme { kEmpty, kLocal, kFlagsSys, kFlagsGpu, kLines };

struct Buffers {
  const uint4* rows;    // [R, kRowVectors] the tokens
  uint4* slots;         // [R, kRowVectors] plain slots, or [R, kRowLines, 8] Pair64 lines
  uint64_t* flags;      // [blocks] one per block
  uint4* out;           // [R, kRowVectors]
  int64_t num_rows;
};

__device__ __forceinline__ void Release(uint64_t* flag, uint64_t value, bool system) {
  if (system) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
  } else {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
  }
}

__device__ __forceinline__ uint64_t Acquire(const uint64_t* flag, bool system) {
  uint64_t value;
  if (system) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  } else {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  }
  return value;
}

// Word pair j / 2 of the row (j even; zeros past the row), as one 8-byte access.
__device__ __forceinline__ uint64_t RowPair(const uint2* row, int64_t j) {
  if (j >= kRowWords) return 0;
  const uint2 v = row[j / 2];
  return v.x | uint64_t{v.y} << 32;
}

// Every payload word travels XORed with its call's epoch, so that a copy of an earlier call's slots fails the
// check: every call sends the same rows.
__device__ __forceinline__ uint4 Mixed(uint4 v, uint32_t key) { return {v.x ^ key, v.y ^ key, v.z ^ key, v.w ^ key}; }
__device__ __forceinline__ uint64_t Mixed(uint64_t v, uint32_t key) { return v ^ (uint64_t{key} << 32 | key); }

// Spins until done() or the wait outlasts kMostWaitNs; then traps (the launch's error says so).
template <typename Done>
__device__ __forceinline__ void WaitFor(Done done) {
  const uint64_t start = jax_ncclx::GlobalTimerNs();
  while (!done()) {
    if (jax_ncclx::GlobalTimerNs() - start > kMostWaitNs) __trap();
  }
}

template <Scheme kScheme>
__global__ void __launch_bounds__(kThreads, 1) SignalKernel(Buffers b, uint64_t epoch) {
  if constexpr (kScheme == Scheme::kEmpty) return;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarps, warp = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  // Rows are read back by the warp at the other end of the grid (another block on an even grid, as one block
  // per SM gives on the H100 and H200), except in kLocal, which reads what it wrote itself.
  const int64_t reader = kScheme == Scheme::kLocal ? warp : warps - 1 - warp;
  const uint32_t key = static_cast<uint32_t>(epoch);
  if constexpr (kScheme == Scheme::kLines) {
    // A warp takes kLinesPerWarpStep lines a step (lane / 8: which, lane % 8: its part), all rows' lines in order.
    const int part = lane % kLanesPerLine;
    const bool flag_part = part == kLanesPerLine - 1;
    const int64_t lines = b.num_rows * kRowLines;
    Pair64* slots = reinterpret_cast<Pair64*>(b.slots);
    for (int64_t step = warp * kLinesPerWarpStep; step < lines; step += warps * kLinesPerWarpStep) {
      const int64_t line = step + lane / kLanesPerLine;
      if (line >= lines) continue;
      const int64_t r = line / kRowLines, first = (line % kRowLines) * kLinePayloadWords + part * 4;
      const uint2* row = reinterpret_cast<const uint2*>(b.rows + r * kRowVectors);
      const uint64_t lo = Mixed(RowPair(row, first), key);
      const uint64_t hi = flag_part ? epoch : Mixed(RowPair(row, first + 2), key);
      StoreVolatile(slots + line * kLanesPerLine + part, Pair64{lo, hi});
    }
    for (int64_t step = reader * kLinesPerWarpStep; step < lines; step += warps * kLinesPerWarpStep) {
      const int64_t line = step + lane / kLanesPerLine;
      const bool valid = line < lines;
      Pair64 got = valid ? LoadVolatile(slots + line * kLanesPerLine + part) : Pair64{};
      // A line is whole once its flag part holds the epoch; the warp polls until its 4 lines are.
      WaitFor([&] {
        if (__all_sync(0xffffffffu, !valid || !flag_part || got.hi == epoch)) return true;
        if (valid) got = LoadVolatile(slots + line * kLanesPerLine + part);
        return false;
      });
      if (!valid) continue;
      const int64_t r = line / kRowLines, first = (line % kRowLines) * kLinePayloadWords + part * 4;
      uint2* to = reinterpret_cast<uint2*>(b.out + r * kRowVectors);
      const uint64_t lo = Mixed(got.lo, key), hi = Mixed(got.hi, key);
      if (first < kRowWords) to[first / 2] = make_uint2(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32));
      if (!flag_part && first + 2 < kRowWords) {
        to[first / 2 + 1] = make_uint2(static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
      }
    }
  } else {
    // A warp per (row, piece), as the MoE kernels share rows out.
    const jax_ncclx::Units units(b.num_rows, kRowVectors, warps);
    for (int64_t unit = warp; unit < units.count(); unit += warps) {
      const auto [r, lo, hi] = units.At(unit);
      for (int64_t v = lo + lane; v < hi; v += 32)
        b.slots[r * kRowVectors + v] = Mixed(b.rows[r * kRowVectors + v], key);
    }
    if constexpr (kScheme == Scheme::kFlagsSys || kScheme == Scheme::kFlagsGpu) {
      constexpr bool kSystem = kScheme == Scheme::kFlagsSys;
      __syncthreads();
      if (threadIdx.x == 0) Release(&b.flags[blockIdx.x], epoch, kSystem);
      for (int64_t i = threadIdx.x; i < gridDim.x; i += kThreads) {
        WaitFor([&] { return Acquire(&b.flags[i], kSystem) == epoch; });
      }
      __syncthreads();
    }
    for (int64_t unit = reader; unit < units.count(); unit += warps) {
      const auto [r, lo, hi] = units.At(unit);
      for (int64_t v = lo + lane; v < hi; v += 32)
        b.out[r * kRowVectors + v] = Mixed(b.slots[r * kRowVectors + v], key);
    }
  }
}

}  // namespace decode_signal

namespace decode_signal {

struct Case {
  const char* name;
  Scheme scheme;
  void (*kernel)(Buffers, uint64_t);
};

constexpr Case kCases[] = {
    {"empty", Scheme::kEmpty, SignalKernel<Scheme::kEmpty>},
    {"local", Scheme::kLocal, SignalKernel<Scheme::kLocal>},
    {"flags.sys", Scheme::kFlagsSys, SignalKernel<Scheme::kFlagsSys>},
    {"flags.gpu", Scheme::kFlagsGpu, SignalKernel<Scheme::kFlagsGpu>},
    {"lines", Scheme::kLines, SignalKernel<Scheme::kLines>},
};

constexpr int kLaunches = 200, kRuns = 9;

// Median over kRuns of the mean µs per call of kLaunches back-to-back calls, epochs counting on from `epoch`.
double MicrosPerCall(const Case& c, const Buffers& b, int blocks, cudaStream_t stream, uint64_t& epoch) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) c.kernel<<<blocks, kThreads, 0, stream>>>(b, ++epoch);  // warm-up
  std::vector<float> ms(kRuns);
  for (float& t : ms) {
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < kLaunches; ++i) c.kernel<<<blocks, kThreads, 0, stream>>>(b, ++epoch);
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    Check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
  }
  Check(cudaGetLastError(), c.name);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[kRuns / 2] / kLaunches;
}

}  // namespace decode_signal

int main() {
  using namespace decode_signal;
  int sms = 0;
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  for (const Case& c : kCases) {  // the flag wait spins on every block: all must be resident at once
    int per_sm = 0;
    Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, c.kernel, kThreads, 0), "occupancy");
    if (per_sm < 1) {
      std::fprintf(stderr, "%s: no block of %d threads fits an SM\n", c.name, kThreads);
      return 1;
    }
  }
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  std::printf("%-6s %-10s %10s  (one block per SM: %d blocks of %d threads; rows of %lld bytes)\n", "rows", "scheme",
              "us/call", sms, kThreads, static_cast<long long>(kRowBytes));
  for (const int64_t num_rows : {int64_t{16}, int64_t{128}}) {
    const int64_t row_bytes = num_rows * kRowBytes, line_bytes = num_rows * kRowLines * kLanesPerLine * 16;
    std::vector<uint32_t> host(row_bytes / 4);
    uint32_t seed = 12345;
    for (uint32_t& w : host) w = seed = seed * 1664525u + 1013904223u;
    uint4 *rows, *slots, *out;
    uint64_t* flags;
    Check(cudaMalloc(&rows, row_bytes), "cudaMalloc");
    Check(cudaMalloc(&slots, std::max(row_bytes, line_bytes)), "cudaMalloc");
    Check(cudaMalloc(&out, row_bytes), "cudaMalloc");
    Check(cudaMalloc(&flags, sms * sizeof(uint64_t)), "cudaMalloc");
    Check(cudaMemcpy(rows, host.data(), row_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    const Buffers b{rows, slots, flags, out, num_rows};
    for (const Case& c : kCases) {
      Check(cudaMemset(slots, 0, std::max(row_bytes, line_bytes)), "cudaMemset");
      Check(cudaMemset(flags, 0, sms * sizeof(uint64_t)), "cudaMemset");
      Check(cudaMemset(out, 0, row_bytes), "cudaMemset");
      uint64_t epoch = 0;
      const double us = MicrosPerCall(c, b, sms, stream, epoch);
      Check(cudaStreamSynchronize(stream), c.name);
      std::vector<uint32_t> got(row_bytes / 4);
      Check(cudaMemcpy(got.data(), out, row_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
      const bool moves = c.scheme != Scheme::kEmpty;
      if (moves && std::memcmp(got.data(), host.data(), row_bytes) != 0) {
        std::fprintf(stderr, "%s at %lld rows: the rows copied out differ from the rows sent\n", c.name,
                     static_cast<long long>(num_rows));
        return 1;
      }
      std::printf("%-6lld %-10s %10.2f\n", static_cast<long long>(num_rows), c.name, us);
    }
    cudaFree(rows);
    cudaFree(slots);
    cudaFree(out);
    cudaFree(flags);
  }
  return 0;
}
