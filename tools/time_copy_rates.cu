// Kernel-only memory rates on one GPU: moe.dispatch's row expansion (take_rows and expand_rows, from
// xla_ffi/ops/take_rows/take_rows_kernels.cu) beside the device's copy and store ceilings, and the same
// expansion with other load and store hints. A diagnostic for the copy kernels, not a benchmark (no XLA
// baseline; time the moe layer with benchmarks/all_to_allv.py). Build and run from the repository root on a
// GPU machine:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ixla_ffi tools/time_copy_rates.cu -o /tmp/time_copy && /tmp/time_copy
//
// Shape: all_to_allv.py's dispatch at T = 4096 on one GPU: 4096 received rows of 7168 bf16 (14 KiB), each
// expanded into 8 expert-major rows (top-8 of 8 experts: expert e's rows are every token in order), 470 MB
// written. The ceilings move the same 470 MB: cudaMemcpyAsync, a copy kernel (16-byte vectors, four loads in
// flight per lane), cudaMemsetAsync and a store kernel, each kernel with plain and streaming (.cs) hints.
// Every timed launch is checked against the expected bytes once. Each time is the median of 20 launches
// between CUDA events, after two warm-ups. Rates count the fewest bytes a variant must move (each input read
// once, each output written once): 59 + 470 MB for every expansion, so they compare with each other and with
// the ceilings' rates.
#include "ops/take_rows/take_rows_kernels.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

namespace copy_rates {  // named: nvcc's kernel stubs cannot tell two anonymous namespaces apart

using namespace jax_ncclx;

void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

constexpr int64_t kTokens = 4096, kTopK = 8, kRowBytes = 7168 * 2;
constexpr int64_t kVectors = kRowBytes / 16;  // per row
constexpr int kBlockThreads = 256, kLoadsInFlight = 4;

// Loads and stores by hint: as XLA's kernels do (plain), or streaming (.cs: evict first, for data used once).
enum class Hint { kPlain, kStreaming };

template <Hint kHint>
__device__ __forceinline__ uint4 Load(const uint4* p) {
  if constexpr (kHint == Hint::kStreaming) return __ldcs(p);
  return *p;
}
template <Hint kHint>
__device__ __forceinline__ void Store(uint4* p, uint4 v) {
  if constexpr (kHint == Hint::kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// dst[i] = src[i] over n vectors, grid-stride, kLoadsInFlight loads per thread before its stores.
template <Hint kHint>
__global__ void __launch_bounds__(kBlockThreads) CopyKernel(const uint4* src, uint4* dst, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * kBlockThreads;
  for (int64_t base = int64_t{blockIdx.x} * kBlockThreads + threadIdx.x; base < n; base += stride * kLoadsInFlight) {
    uint4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (base + u * stride < n) v[u] = Load<kHint>(src + base + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (base + u * stride < n) Store<kHint>(dst + base + u * stride, v[u]);
    }
  }
}

template <Hint kHint>
__global__ void __launch_bounds__(kBlockThreads) StoreKernel(uint4* dst, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * kBlockThreads;
  for (int64_t i = int64_t{blockIdx.x} * kBlockThreads + threadIdx.x; i < n; i += stride)
    Store<kHint>(dst + i, uint4{});
}

// The expansion walked by source row, a warp per (row, chunk of 32 * kLoadsInFlight vectors): the chunk is read
// once and stored to the row's k outputs (expand_rows' walk, with the hint as a parameter).
template <Hint kHint>
__global__ void __launch_bounds__(kBlockThreads) ExpandKernel(const uint4* x, const int32_t* sources, uint4* out) {
  constexpr int64_t kChunk = 32 * kLoadsInFlight, kChunks = (kVectors + kChunk - 1) / kChunk;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (kBlockThreads / 32);
  for (int64_t item = int64_t{blockIdx.x} * (kBlockThreads / 32) + threadIdx.x / 32; item < kTokens * kChunks;
       item += warps) {
    const int64_t r = item / kChunks, lo = (item % kChunks) * kChunk;
    uint4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t at = lo + lane + u * 32;
      if (at < kVectors) v[u] = Load<kHint>(x + r * kVectors + at);
    }
    for (int j = 0; j < kTopK; ++j) {
      const int64_t o = sources[r * kTopK + j];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int64_t at = lo + lane + u * 32;
        if (at < kVectors) Store<kHint>(out + o * kVectors + at, v[u]);
      }
    }
  }
}

// Median µs of `launch(stream)` over 20 launches timed one by one with events, after two warm-ups.
template <typename Launch>
double Micros(cudaStream_t stream, Launch launch) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 2; ++i) launch();
  Check(cudaGetLastError(), "warm-up launch");
  std::vector<float> ms(20);
  for (float& t : ms) {
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    Check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
  }
  Check(cudaGetLastError(), "launch");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[ms.size() / 2];
}

}  // namespace copy_rates

int main() {
  using namespace copy_rates;
  const int64_t out_rows = kTokens * kTopK, in_bytes = kTokens * kRowBytes, out_bytes = out_rows * kRowBytes;
  int sms = 0;
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");

  // Host data: random source rows; expert e's rows are the tokens in order (index), and its inverse (sources).
  std::vector<uint8_t> x_host(in_bytes);
  uint32_t state = 12345;
  for (auto& b : x_host) b = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
  std::vector<int32_t> index(out_rows), sources(kTokens * kTopK);
  for (int64_t e = 0; e < kTopK; ++e) {
    for (int64_t t = 0; t < kTokens; ++t) {
      index[e * kTokens + t] = static_cast<int32_t>(t);
      sources[t * kTopK + e] = static_cast<int32_t>(e * kTokens + t);
    }
  }
  std::vector<uint8_t> expected(out_bytes);
  for (int64_t o = 0; o < out_rows; ++o)
    std::memcpy(&expected[o * kRowBytes], &x_host[index[o] * kRowBytes], kRowBytes);

  uint8_t *x, *big, *out;
  int32_t *index_d, *sources_d;
  Check(cudaMalloc(&x, in_bytes), "cudaMalloc");
  Check(cudaMalloc(&big, out_bytes), "cudaMalloc");
  Check(cudaMalloc(&out, out_bytes), "cudaMalloc");
  Check(cudaMalloc(&index_d, out_rows * 4), "cudaMalloc");
  Check(cudaMalloc(&sources_d, kTokens * kTopK * 4), "cudaMalloc");
  Check(cudaMemcpy(x, x_host.data(), in_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(big, expected.data(), out_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(index_d, index.data(), out_rows * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(sources_d, sources.data(), kTokens * kTopK * 4, cudaMemcpyHostToDevice), "cudaMemcpy");

  std::vector<uint8_t> got(out_bytes);
  // Poisons out, runs once, and compares out with `want` (null: all zeros).
  auto check = [&](const char* name, auto launch, const uint8_t* want) {
    Check(cudaMemset(out, 0xab, out_bytes), "cudaMemset");
    launch();
    Check(cudaStreamSynchronize(stream), name);
    Check(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    const bool ok = want != nullptr ? std::memcmp(got.data(), want, out_bytes) == 0
                                    : std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0; });
    if (!ok) {
      std::fprintf(stderr, "%s: wrong bytes\n", name);
      std::exit(1);
    }
  };
  const TakeRowsShape shape{1, kTokens, out_rows, kRowBytes, kRowBytes, 0};
  const int64_t n = out_bytes / 16;
  const unsigned grid = static_cast<unsigned>(sms * 8);  // enough blocks to fill the SMs
  struct Case {
    const char* name;
    int64_t read, written;
    std::function<void()> launch;
    const uint8_t* want;
  };
  auto u4 = [](void* p) { return static_cast<uint4*>(p); };
  const std::vector<Case> cases = {
      {"cudaMemcpyAsync (device to device)", out_bytes, out_bytes,
       [&] { Check(cudaMemcpyAsync(out, big, out_bytes, cudaMemcpyDeviceToDevice, stream), "memcpy"); },
       expected.data()},
      {"copy kernel, plain", out_bytes, out_bytes,
       [&] { CopyKernel<Hint::kPlain><<<grid, kBlockThreads, 0, stream>>>(u4(big), u4(out), n); }, expected.data()},
      {"copy kernel, streaming", out_bytes, out_bytes,
       [&] { CopyKernel<Hint::kStreaming><<<grid, kBlockThreads, 0, stream>>>(u4(big), u4(out), n); }, expected.data()},
      {"cudaMemsetAsync", 0, out_bytes, [&] { Check(cudaMemsetAsync(out, 0, out_bytes, stream), "memset"); }, nullptr},
      {"store kernel, plain", 0, out_bytes,
       [&] { StoreKernel<Hint::kPlain><<<grid, kBlockThreads, 0, stream>>>(u4(out), n); }, nullptr},
      {"store kernel, streaming", 0, out_bytes,
       [&] { StoreKernel<Hint::kStreaming><<<grid, kBlockThreads, 0, stream>>>(u4(out), n); }, nullptr},
      {"take_rows (expert rows read their row)", in_bytes, out_bytes,
       [&] { Check(LaunchTakeRows(shape, x, index_d, nullptr, out, stream), "take_rows"); }, expected.data()},
      {"expand_rows (each row read once)", in_bytes, out_bytes,
       [&] { Check(LaunchExpandRows(shape, kTopK, x, index_d, sources_d, out, stream), "expand_rows"); },
       expected.data()},
      {"expand walk, plain, no zero pass", in_bytes, out_bytes,
       [&] { ExpandKernel<Hint::kPlain><<<grid, kBlockThreads, 0, stream>>>(u4(x), sources_d, u4(out)); },
       expected.data()},
      {"expand walk, streaming, no zero pass", in_bytes, out_bytes,
       [&] { ExpandKernel<Hint::kStreaming><<<grid, kBlockThreads, 0, stream>>>(u4(x), sources_d, u4(out)); },
       expected.data()},
  };
  std::printf("%d SMs; %lld source rows of %lld bytes, %lld expert rows (%.0f MB written)\n", sms,
              static_cast<long long>(kTokens), static_cast<long long>(kRowBytes), static_cast<long long>(out_rows),
              out_bytes / 1e6);
  std::printf("%-42s %10s %10s\n", "variant", "us", "TB/s");
  for (const Case& c : cases) {
    check(c.name, c.launch, c.want);
    const double us = Micros(stream, c.launch);
    std::printf("%-42s %10.1f %10.2f\n", c.name, us, (c.read + c.written) / us / 1e6);
  }
  return 0;
}
